package criurun

import (
	"bufio"
	"bytes"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"sort"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/containerd/errdefs"
	"golang.org/x/sys/unix"
)

// StartOptions tune Start.
type StartOptions struct {
	Stdout string   // file (created or truncated) for stdout and stderr; "" = /dev/null
	Env    []string // nil = the caller's environment
	Dir    string   // working directory; "" = the caller's
	// SamePIDNS keeps the workload in the caller's PID namespace; its dump can then
	// be restored only once the original is gone (PIDs collide).
	SamePIDNS bool
}

// Workload is a program started by Start.
type Workload struct {
	PID int // host PID; PID 1 of its own namespace unless SamePIDNS
	cmd *exec.Cmd
	// done is closed when the process has been reaped; err holds its wait error.
	done chan struct{}
	err  error
}

// Start runs args as the init of a new PID namespace, in its own session, with stdin
// from /dev/null and stdout and stderr into opts.Stdout, ready to be dumped.
func Start(args []string, opts StartOptions) (*Workload, error) {
	if len(args) == 0 || args[0] == "" {
		return nil, fmt.Errorf("start: empty command: %w", errdefs.ErrInvalidArgument)
	}
	cmd := exec.Command(args[0], args[1:]...)
	cmd.Env, cmd.Dir = opts.Env, opts.Dir
	if opts.Stdout != "" {
		f, err := os.OpenFile(opts.Stdout, os.O_WRONLY|os.O_CREATE|os.O_TRUNC|os.O_APPEND, 0o644)
		if err != nil {
			return nil, fmt.Errorf("start: %w", err)
		}
		defer f.Close()
		cmd.Stdout, cmd.Stderr = f, f
	}
	cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true}
	if !opts.SamePIDNS {
		cmd.SysProcAttr.Cloneflags = unix.CLONE_NEWPID
	}
	if err := cmd.Start(); err != nil {
		return nil, fmt.Errorf("start %q: %w", args[0], err)
	}
	w := &Workload{PID: cmd.Process.Pid, cmd: cmd, done: make(chan struct{})}
	go func() { w.err = cmd.Wait(); close(w.done) }()
	return w, nil
}

// Kill stops the workload with SIGKILL and waits until it is reaped.
func (w *Workload) Kill() error {
	select {
	case <-w.done:
		return nil
	default:
	}
	if err := w.cmd.Process.Kill(); err != nil && !errors.Is(err, os.ErrProcessDone) {
		return err
	}
	<-w.done
	return nil
}

// Exited reports whether the workload has exited, with its wait error.
func (w *Workload) Exited() (bool, error) {
	select {
	case <-w.done:
		return true, w.err
	default:
		return false, nil
	}
}

// BecomeSubreaper makes the calling process the reaper of orphans in its subtree, so
// detached restored copies are re-parented to it and Kill can reap them.
func BecomeSubreaper() error {
	return unix.Prctl(unix.PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
}

// Kill sends SIGKILL to pid (the init of a restored namespace ignores SIGTERM) and
// waits up to 10 s for it to be gone, reaping it when it is the caller's child.
// A process that does not exist any more is not an error.
func Kill(pid int) error {
	if pid <= 0 {
		return fmt.Errorf("kill: bad pid %d: %w", pid, errdefs.ErrInvalidArgument)
	}
	if err := unix.Kill(pid, unix.SIGKILL); err != nil {
		if errors.Is(err, unix.ESRCH) {
			return nil
		}
		return fmt.Errorf("kill %d: %w", pid, err)
	}
	deadline := time.Now().Add(10 * time.Second)
	for time.Now().Before(deadline) {
		var ws unix.WaitStatus
		wp, err := unix.Wait4(pid, &ws, unix.WNOHANG, nil)
		if wp == pid {
			return nil
		}
		if errors.Is(err, unix.ECHILD) {
			// Not ours: wait for it to leave /proc (or turn into someone else's zombie).
			if st, err := readStat(pid); err != nil || st.state == 'Z' || st.state == 'X' {
				return nil
			}
		}
		time.Sleep(5 * time.Millisecond)
	}
	return fmt.Errorf("kill %d: still there after 10 s", pid)
}

// Alive reports whether pid exists and is not a zombie.
func Alive(pid int) (bool, error) {
	st, err := readStat(pid)
	if err != nil {
		return false, err
	}
	return st.state != 'Z' && st.state != 'X', nil
}

// IsPIDNSInit reports whether pid is PID 1 of a PID namespace other than the caller's.
func IsPIDNSInit(pid int) (bool, error) {
	mine, err := os.Readlink("/proc/self/ns/pid")
	if err != nil {
		return false, err
	}
	theirs, err := os.Readlink(fmt.Sprintf("/proc/%d/ns/pid", pid))
	if err != nil {
		return false, fmt.Errorf("process %d: %w", pid, err)
	}
	if mine == theirs {
		return false, nil
	}
	nspid, err := NSPID(pid)
	if err != nil {
		return false, err
	}
	return nspid == 1, nil
}

// NSPID returns pid as seen inside its own (innermost) PID namespace.
func NSPID(pid int) (int, error) {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		return 0, fmt.Errorf("process %d: %w", pid, errdefs.ErrNotFound)
	}
	for _, l := range strings.Split(string(b), "\n") {
		if f, ok := strings.CutPrefix(l, "NSpid:"); ok {
			fs := strings.Fields(f)
			if len(fs) == 0 {
				break
			}
			return strconv.Atoi(fs[len(fs)-1])
		}
	}
	return 0, fmt.Errorf("process %d: no NSpid in status", pid)
}

type stat struct {
	state     byte
	ppid, sid int
}

func readStat(pid int) (stat, error) {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return stat{}, fmt.Errorf("process %d: %w", pid, errdefs.ErrNotFound)
	}
	// The command name may hold spaces and parentheses: fields start after the last ')'.
	i := bytes.LastIndexByte(b, ')')
	if i < 0 {
		return stat{}, fmt.Errorf("process %d: bad stat", pid)
	}
	f := strings.Fields(string(b[i+1:]))
	if len(f) < 5 {
		return stat{}, fmt.Errorf("process %d: bad stat", pid)
	}
	ppid, _ := strconv.Atoi(f[1])
	sid, _ := strconv.Atoi(f[3])
	return stat{state: f[0][0], ppid: ppid, sid: sid}, nil
}

// Tree returns pid and all its descendant processes (not threads), parents first.
func Tree(pid int) ([]int, error) {
	if _, err := readStat(pid); err != nil {
		return nil, err
	}
	out := []int{pid}
	for i := 0; i < len(out); i++ {
		kids, _ := children(out[i])
		out = append(out, kids...)
	}
	return out, nil
}

func children(pid int) ([]int, error) {
	tasks, err := os.ReadDir(fmt.Sprintf("/proc/%d/task", pid))
	if err != nil {
		return nil, err
	}
	var kids []int
	for _, t := range tasks {
		b, err := os.ReadFile(fmt.Sprintf("/proc/%d/task/%s/children", pid, t.Name()))
		if err != nil {
			continue
		}
		for _, f := range strings.Fields(string(b)) {
			if k, err := strconv.Atoi(f); err == nil {
				kids = append(kids, k)
			}
		}
	}
	sort.Ints(kids)
	return kids, nil
}

// Mem is the memory of a process or a tree, in bytes.
type Mem struct {
	RssAnon  int64 // private anonymous pages: what a copy costs on its own
	RssFile  int64
	RssShmem int64 // shared-memory and tmpfs pages, memory files included
	Pss      int64 // proportional share of everything mapped
	PssAnon  int64
	PssShmem int64
}

// Add returns m + o.
func (m Mem) Add(o Mem) Mem {
	return Mem{m.RssAnon + o.RssAnon, m.RssFile + o.RssFile, m.RssShmem + o.RssShmem,
		m.Pss + o.Pss, m.PssAnon + o.PssAnon, m.PssShmem + o.PssShmem}
}

// ProcMem reads one process's memory from /proc/PID/status and smaps_rollup.
func ProcMem(pid int) (Mem, error) {
	var m Mem
	err := scanKB(fmt.Sprintf("/proc/%d/status", pid), map[string]*int64{
		"RssAnon:": &m.RssAnon, "RssFile:": &m.RssFile, "RssShmem:": &m.RssShmem,
	})
	if err != nil {
		return m, err
	}
	err = scanKB(fmt.Sprintf("/proc/%d/smaps_rollup", pid), map[string]*int64{
		"Pss:": &m.Pss, "Pss_Anon:": &m.PssAnon, "Pss_Shmem:": &m.PssShmem,
	})
	return m, err
}

// TreeMem sums ProcMem over pid and its descendants. Processes that exit while
// being read are skipped.
func TreeMem(pid int) (Mem, error) {
	pids, err := Tree(pid)
	if err != nil {
		return Mem{}, err
	}
	var total Mem
	for i, p := range pids {
		m, err := ProcMem(p)
		if err != nil {
			if i == 0 {
				return Mem{}, err
			}
			continue
		}
		total = total.Add(m)
	}
	return total, nil
}

func scanKB(path string, want map[string]*int64) error {
	f, err := os.Open(path)
	if err != nil {
		return fmt.Errorf("%s: %w", path, errdefs.ErrNotFound)
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		fs := strings.Fields(sc.Text())
		if len(fs) < 2 {
			continue
		}
		if p, ok := want[fs[0]]; ok {
			v, err := strconv.ParseInt(fs[1], 10, 64)
			if err != nil {
				return fmt.Errorf("%s: %q: %w", path, sc.Text(), err)
			}
			*p = v * 1024
		}
	}
	return sc.Err()
}
