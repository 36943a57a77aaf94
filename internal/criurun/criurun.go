package criurun

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync/atomic"
	"time"

	// crit/images/stats, not go-criu's top-level stats package: both register
	// the same proto file, so the module links only this one.
	"github.com/checkpoint-restore/go-criu/v7/crit/images/stats"
	"github.com/containerd/errdefs"

	"github.com/lazyfork/lazyfork/criuimg"
	"github.com/lazyfork/lazyfork/internal/hwbreak"
	"github.com/lazyfork/lazyfork/internal/procfs"
)

// Names of the files this package writes into an image directory.
const (
	DumpLog  = "dump.log"
	MetaFile = "criurun.json"
)

// DefaultBinary is the criu used when an option leaves it empty: the one on PATH,
// or /usr/local/sbin/criu where `make deps` installs it.
func DefaultBinary() string {
	if p, err := exec.LookPath("criu"); err == nil {
		return p
	}
	return "/usr/local/sbin/criu"
}

// DumpOptions tune Dump. The zero value is a leave-running dump that detects shell jobs.
type DumpOptions struct {
	Criu      string   // criu binary; "" = DefaultBinary()
	Kill      bool     // stop the tree after the dump instead of leaving it running
	ShellJob  *bool    // nil = detect: the root is not the leader of its own session
	ExtraArgs []string // appended to criu's command line as they are
}

// Meta is what Dump records beside the image (MetaFile) for Restore.
type Meta struct {
	PID      int       `json:"pid"`       // root PID in the host's namespace at dump time
	PIDNS    bool      `json:"pidns"`     // the root was the init of its own PID namespace
	ShellJob bool      `json:"shell_job"` // dumped with --shell-job (so restore needs it too)
	Stdio    [3]string `json:"stdio"`     // targets of fds 0-2 as /proc/PID/fd showed them
	Dumped   time.Time `json:"dumped"`
}

// DumpResult describes a finished dump.
type DumpResult struct {
	Meta
	Duration time.Duration // wall time of the criu process
	Log      string        // path of CRIU's log
	// From CRIU's stats-dump (zero if it wrote none).
	FrozenTime   time.Duration // how long the tree stayed frozen
	PagesWritten uint64
}

// Dump checkpoints the process tree rooted at pid into dir (created if missing,
// which must be empty of images). The tree keeps running unless opts.Kill is set.
func Dump(ctx context.Context, pid int, dir string, opts DumpOptions) (*DumpResult, error) {
	if pid <= 0 {
		return nil, fmt.Errorf("dump: bad pid %d: %w", pid, errdefs.ErrInvalidArgument)
	}
	if _, err := os.Stat(fmt.Sprintf("/proc/%d", pid)); err != nil {
		return nil, fmt.Errorf("dump: process %d: %w", pid, errdefs.ErrNotFound)
	}
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return nil, fmt.Errorf("dump: %w", err)
	}
	if _, err := os.Stat(filepath.Join(dir, "inventory.img")); err == nil {
		return nil, fmt.Errorf("dump: %s already holds an image: %w", dir, errdefs.ErrAlreadyExists)
	}
	meta := Meta{PID: pid, Dumped: time.Now().UTC()}
	for fd := 0; fd < 3; fd++ {
		meta.Stdio[fd], _ = os.Readlink(fmt.Sprintf("/proc/%d/fd/%d", pid, fd))
	}
	var err error
	if meta.PIDNS, err = procfs.IsPIDNSInit(pid); err != nil {
		return nil, fmt.Errorf("dump: %w", err)
	}
	st, err := procfs.ReadStat(pid)
	if err != nil {
		return nil, fmt.Errorf("dump: %w", err)
	}
	if meta.PIDNS && st.Session != pid {
		// CRIU refuses it ("A session leader ... is outside of its pid namespace"),
		// and --shell-job does not help for a namespace.
		return nil, fmt.Errorf("dump: pid %d is PID 1 of its namespace, but its session leader (%d) is outside: start it in a session of its own (`unshare --pid --fork setsid PROG`; Start does this): %w",
			pid, st.Session, errdefs.ErrInvalidArgument)
	}
	if opts.ShellJob != nil {
		meta.ShellJob = *opts.ShellJob
	} else {
		meta.ShellJob = st.Session != pid
	}
	args := []string{"dump", "-t", strconv.Itoa(pid), "-D", dir, "-o", DumpLog, "-v4"}
	if !opts.Kill {
		args = append(args, "--leave-running")
	}
	if meta.ShellJob {
		args = append(args, "--shell-job")
	}
	args = append(args, opts.ExtraArgs...)
	abs, _ := filepath.Abs(dir)
	logPath := filepath.Join(abs, DumpLog)
	start := time.Now()
	if err := runCriu(ctx, opts.Criu, args, logPath, nil); err != nil {
		return nil, fmt.Errorf("criu dump of pid %d into %s: %w", pid, dir, err)
	}
	res := &DumpResult{Meta: meta, Duration: time.Since(start), Log: logPath}
	if st := readStats(filepath.Join(dir, "stats-dump")); st != nil {
		res.FrozenTime = time.Duration(st.GetDump().GetFrozenTime()) * time.Microsecond
		res.PagesWritten = st.GetDump().GetPagesWritten()
	}
	if err := writeJSONAtomic(filepath.Join(dir, MetaFile), meta); err != nil {
		return nil, fmt.Errorf("dump: %w", err)
	}
	return res, nil
}

// ReadMeta reads what Dump recorded beside an image. It wraps errdefs.ErrNotFound
// when the directory was not made by Dump (a copy may still restore without it).
func ReadMeta(dir string) (*Meta, error) {
	b, err := os.ReadFile(filepath.Join(dir, MetaFile))
	if errors.Is(err, os.ErrNotExist) {
		return nil, fmt.Errorf("%s: no %s: %w", dir, MetaFile, errdefs.ErrNotFound)
	}
	if err != nil {
		return nil, err
	}
	var m Meta
	if err := json.Unmarshal(b, &m); err != nil {
		return nil, fmt.Errorf("%s: bad %s: %w", dir, MetaFile, err)
	}
	return &m, nil
}

// RestoreOptions tune Restore.
type RestoreOptions struct {
	Criu string // criu binary; "" = DefaultBinary()
	// Stdout, if set, is the file (created or truncated) that the copy's stdout and
	// stderr go to, in place of the files the parent had open. It needs the dump's
	// MetaFile and both fds pointing at regular files or devices.
	Stdout string
	// WorkDir receives CRIU's log and pid file; "" = a fresh temporary directory,
	// removed after a successful restore and kept (named in the error) after a failure.
	WorkDir   string
	ExtraArgs []string // appended to criu's command line as they are
}

// RestoreResult describes a restored copy.
type RestoreResult struct {
	PID      int           // the copy's root PID in the host's namespace
	Duration time.Duration // wall time of the criu process
	// From CRIU's stats-restore (zero if it wrote none).
	CRIUTime      time.Duration // CRIU's own restore_time
	ForkingTime   time.Duration
	PagesRestored uint64 // pages CRIU copied from the image into the copy
}

var restoreSeq atomic.Uint64

// Restore restores the image in dir as a new, detached process tree and returns the
// PID of its root. Restoring the same dir many times, even at once, is allowed when
// the dump holds its own PID namespace (see the package doc).
func Restore(ctx context.Context, dir string, opts RestoreOptions) (*RestoreResult, error) {
	if _, err := os.Stat(filepath.Join(dir, "inventory.img")); err != nil {
		return nil, fmt.Errorf("restore: %s holds no CRIU image: %w", dir, errdefs.ErrNotFound)
	}
	meta, merr := ReadMeta(dir)
	work := opts.WorkDir
	tmpWork := work == ""
	if tmpWork {
		var err error
		if work, err = os.MkdirTemp("", "criurun-restore-"); err != nil {
			return nil, fmt.Errorf("restore: %w", err)
		}
	} else if err := os.MkdirAll(work, 0o700); err != nil {
		return nil, fmt.Errorf("restore: %w", err)
	}
	seq := restoreSeq.Add(1)
	logName := fmt.Sprintf("restore-%d-%d.log", os.Getpid(), seq)
	pidName := fmt.Sprintf("restore-%d-%d.pid", os.Getpid(), seq)
	args := []string{"restore", "-D", dir, "-W", work, "-o", logName, "-v4",
		"--restore-detached", "--pidfile", pidName, "--manage-cgroups=ignore"}
	if meta != nil && meta.ShellJob {
		args = append(args, "--shell-job")
	}
	var extra []*os.File
	if opts.Stdout != "" {
		if merr != nil {
			return nil, fmt.Errorf("restore: Stdout given but %w", merr)
		}
		f, err := os.OpenFile(opts.Stdout, os.O_WRONLY|os.O_CREATE|os.O_TRUNC|os.O_APPEND, 0o644)
		if err != nil {
			return nil, fmt.Errorf("restore: %w", err)
		}
		defer f.Close()
		// One inherited fd per distinct key: stdout and stderr often share a file.
		seen := map[string]bool{}
		for fd := 1; fd <= 2; fd++ {
			key, ok := inheritKey(meta.Stdio[fd])
			if !ok || seen[key] {
				continue
			}
			seen[key] = true
			extra = append(extra, f)
			args = append(args, "--inherit-fd", fmt.Sprintf("fd[%d]:%s", 2+len(extra), key))
		}
	}
	args = append(args, opts.ExtraArgs...)
	logPath := filepath.Join(work, logName)
	start := time.Now()
	if err := runCriu(ctx, opts.Criu, args, logPath, extra); err != nil {
		return nil, fmt.Errorf("criu restore of %s (work dir %s kept): %w", dir, work, err)
	}
	dur := time.Since(start)
	b, err := os.ReadFile(filepath.Join(work, pidName))
	if err != nil {
		return nil, fmt.Errorf("restore of %s: criu wrote no pid file: %w", dir, err)
	}
	pid, err := strconv.Atoi(strings.TrimSpace(string(b)))
	if err != nil || pid <= 0 {
		return nil, fmt.Errorf("restore of %s: bad pid file %q", dir, b)
	}
	res := &RestoreResult{PID: pid, Duration: dur}
	if st := readStats(filepath.Join(work, "stats-restore")); st != nil {
		res.CRIUTime = time.Duration(st.GetRestore().GetRestoreTime()) * time.Microsecond
		res.ForkingTime = time.Duration(st.GetRestore().GetForkingTime()) * time.Microsecond
		res.PagesRestored = st.GetRestore().GetPagesRestored()
	}
	if tmpWork {
		os.RemoveAll(work)
	} else {
		os.Remove(filepath.Join(work, pidName))
	}
	return res, nil
}

// inheritKey turns an fd target as /proc showed it into CRIU's --inherit-fd key:
// a path without its leading slash (CRIU silently ignores a wrong key and reopens
// the original file). Pipes and sockets keep their "pipe:[ino]" form.
func inheritKey(target string) (string, bool) {
	switch {
	case target == "":
		return "", false
	case strings.HasPrefix(target, "/"):
		if strings.HasSuffix(target, " (deleted)") {
			return "", false
		}
		return strings.TrimPrefix(target, "/"), true
	case strings.HasPrefix(target, "pipe:["):
		return target, true
	}
	return "", false
}

// runCriu runs criu and, on failure, returns an error quoting the tail of its log.
func runCriu(ctx context.Context, bin string, args []string, logPath string, extra []*os.File) error {
	if bin == "" {
		bin = DefaultBinary()
	}
	cmd := exec.CommandContext(ctx, bin, args...)
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &out
	cmd.ExtraFiles = extra
	cmd.Env = hwbreak.CRIUEnv(os.Environ())
	err := cmd.Run()
	if err == nil {
		return nil
	}
	tail := LogTail(logPath, 12)
	if tail == "" {
		tail = strings.TrimSpace(out.String())
	}
	return fmt.Errorf("%v (log %s):\n%s", err, logPath, tail)
}

// LogTail returns the last n lines of a CRIU log that say something: errors first
// if there are any, otherwise the plain tail.
func LogTail(path string, n int) string {
	b, err := os.ReadFile(path)
	if err != nil {
		return ""
	}
	lines := strings.Split(strings.TrimRight(string(b), "\n"), "\n")
	var errs []string
	for _, l := range lines {
		// Every CRIU log carries a harmless rlimit error: leave it out.
		if (strings.Contains(l, "Error") || strings.Contains(l, "error")) && !strings.Contains(l, "RLIMIT_NOFILE") {
			errs = append(errs, l)
		}
	}
	pick := lines
	if len(errs) > 0 {
		pick = errs
	}
	if len(pick) > n {
		pick = pick[len(pick)-n:]
	}
	return strings.Join(pick, "\n")
}

// readStats reads a CRIU stats file, or returns nil: statistics are a bonus.
func readStats(path string) *stats.StatsEntry {
	img, err := criuimg.ReadImage(path, criuimg.MagicStats, criuimg.Of(&stats.StatsEntry{}))
	if err != nil || len(img.Entries) == 0 {
		return nil
	}
	st, _ := img.Entries[0].(*stats.StatsEntry)
	return st
}

func writeJSONAtomic(path string, v any) error {
	b, err := json.MarshalIndent(v, "", "  ")
	if err != nil {
		return err
	}
	tmp := path + ".tmp"
	if err := os.WriteFile(tmp, append(b, '\n'), 0o644); err != nil {
		return err
	}
	return os.Rename(tmp, path)
}
