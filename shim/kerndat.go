package shim

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/containerd/log"
	"golang.org/x/sys/unix"

	"github.com/lazyfork/lazyfork/internal/criuproxy"
	"github.com/lazyfork/lazyfork/internal/hwbreak"
)

// CRIU keeps what it learns about the kernel (its "kerndat": page-map and
// dirty-tracking support, namespaces, vDSO layout, netfilter modules loaded by
// running `iptables -L`, `ip6tables -L` and `iptables -w -L`...) in
// /run/criu.kdat, but only when /run is a tmpfs (the cache must not outlive a
// boot). Where /run is on a disk, every CRIU run probes again: runc's version
// check and each dump and restore pay 10-20 ms of probes and three iptables
// runs.
//
// CRIU reads the cache without checking where it lives, and only writes it
// to a tmpfs. So on such a host the shim makes the cache once per boot and
// CRIU binary (by running criu in a private mount namespace whose /run is a
// fresh tmpfs) and points /run/criu.kdat at it with a symbolic link.
//
// The cache is the same for every CRIU run of that binary on this boot: its
// fields are kernel features, identical whoever probes (the one field that
// depends on the process, libc's rseq area, CRIU probes again on every load).
// So it is shared, not per LazyFork stack, and lives outside any stack's root:
// in kerndatDir, a root-only directory on the host's shared-memory tmpfs. A
// stack going away (`lazyfork setup --down --purge`, a test harness removing
// its root) leaves the link valid for every other stack and CRIU user; only a
// reboot empties the directory, and then the dangling link is harmless (CRIU
// finds no cache and probes, as without one) until a shim links a new cache.
//
// Another CRIU build reading the link rejects the cache (CRIU stamps it with
// its build time and its struct size and discards, and unlinks, a cache of
// another build) and probes. A link to another binary's cache, or a dangling
// one, is replaced; a regular /run/criu.kdat (someone else's choice) is left
// alone. LAZYFORK_CRIU_KDAT=off turns all of this off.

// kerndatLink is where CRIU reads its kernel-feature cache (KDAT_RUNDIR of
// Debian's and upstream's builds).
var kerndatLink = "/run/criu.kdat"

// kerndatDir keeps the caches the shims made, one per CRIU binary and boot.
var kerndatDir = "/dev/shm/lazyfork-criu"

// kerndatHelperArg is RunHook's subcommand that writes a fresh CRIU
// kernel-feature cache on stdout (see runKerndatHelper).
const kerndatHelperArg = "kerndat"

// kdatMagic is the first word of a CRIU kernel-feature cache (KDAT_MAGIC of
// criu/include/magic.h, "Torzhok").
const kdatMagic = 0x57023458

// kerndat makes sure, once per shim, that CRIU finds its cache.
type kerndat struct {
	once sync.Once
	done chan struct{}
}

// ensure starts the one check of this shim and, when wait is set, waits for it
// (a restore waits; a fresh container's create does not): CRIU's
// kernel-feature cache and the version proxy (criuproxy.go).
func (k *kerndat) ensure(ctx context.Context, self string, wait bool) {
	k.once.Do(func() {
		k.done = make(chan struct{})
		go func() {
			defer close(k.done)
			// First: every dump and restore hangs without it where the
			// host's breakpoints do not trap.
			if set, err := setCRIUBreakpoints(self); err != nil {
				log.G(ctx).WithError(err).WithField("criu_fault_set", set).Warn("lazyfork: hardware breakpoint probe")
			} else if set {
				log.G(ctx).Info("lazyfork: hardware breakpoints do not trap on this host (a hypervisor without debug-register virtualization): CRIU runs with CRIU_FAULT=130 (no breakpoints)")
			}
			kdat := os.Getenv("LAZYFORK_CRIU_KDAT") != "off"
			proxy := os.Getenv(criuProxyEnv) != "off"
			if !kdat && !proxy {
				return
			}
			criu, err := realCRIU(self)
			if err != nil {
				log.G(ctx).WithError(err).Warn("lazyfork: CRIU's kernel-feature cache and version proxy are off")
				return
			}
			if kdat {
				if err := ensureKerndatCache(self, criu); err != nil {
					log.G(ctx).WithError(err).Warn("lazyfork: CRIU kernel-feature cache: CRIU probes the kernel on every run")
				}
			}
			if proxy {
				if gateErr, err := setupCRIUProxy(self, criu); err != nil {
					log.G(ctx).WithError(err).Warn("lazyfork: CRIU version proxy: runc runs CRIU twice per checkpoint and restore")
				} else if gateErr != nil {
					log.G(ctx).WithError(gateErr).Warn("lazyfork: CRIU proxy without dump gates: a moving checkpoint starts runc after the move")
				}
			}
		}()
	})
	if wait {
		<-k.done
	}
}

// ensureKerndatCache links kerndatLink to a cache of the CRIU binary criu in
// the cache directory (criuCacheDir) when the link's directory is not a tmpfs
// (see above). self is this binary (the helper that makes the cache).
func ensureKerndatCache(self, criu string) error {
	runDir := filepath.Dir(kerndatLink)
	if tmpfs, err := isTmpfs(runDir); err != nil {
		return err
	} else if tmpfs {
		return nil // CRIU keeps its own cache there
	}
	name, err := kerndatName(criu)
	if err != nil {
		return err
	}
	dir, err := criuCacheDir()
	if err != nil {
		return err
	}
	target := filepath.Join(dir, name)
	fi, err := os.Lstat(kerndatLink)
	switch {
	case errors.Is(err, os.ErrNotExist):
	case err != nil:
		return err
	case fi.Mode()&os.ModeSymlink == 0:
		return nil // a regular file: not ours to replace
	default:
		if cur, err := os.Readlink(kerndatLink); err == nil && cur == target {
			if _, err := os.Stat(target); err == nil {
				return nil
			}
		}
	}
	if _, err := os.Stat(target); err != nil {
		b, err := makeKerndat(self)
		if err != nil {
			return err
		}
		if err := writeFileAtomic(target, b, 0o600); err != nil {
			return err
		}
	}
	// Replace the link in one step: CRIU runs of other shims may read it now.
	tmp := kerndatLink + ".lazyfork-" + strconv.Itoa(os.Getpid())
	_ = os.Remove(tmp)
	if err := os.Symlink(target, tmp); err != nil {
		return err
	}
	if err := os.Rename(tmp, kerndatLink); err != nil {
		os.Remove(tmp)
		return err
	}
	return nil
}

// errNotOurs marks a cache directory path someone else holds.
var errNotOurs = errors.New("not a directory only this user can write")

// kerndatDirRecord names the directory the shims use instead of kerndatDir
// when someone else holds that path (see criuCacheDir). It lives in the
// directory of kerndatLink, which only root can write.
func kerndatDirRecord() string {
	return filepath.Join(filepath.Dir(kerndatLink), "lazyfork-criu.dir")
}

// criuCacheDir is the directory of the CRIU caches: kerndatDir, made
// root-only on the shared-memory tmpfs. /dev/shm is writable by every user
// (sticky), so another user can make that path first; then the caches go to
// a directory of a random name beside it, made by this user (mkdir fails on
// a name someone else took, and in a sticky directory nobody else can rename
// or remove it), whose path is recorded in kerndatDirRecord for the other
// shims. Nothing another user made is followed or trusted: a squatted path
// costs one more directory, not the caches.
func criuCacheDir() (string, error) {
	err := ensureKerndatDir(kerndatDir)
	if err == nil {
		return kerndatDir, nil
	}
	if !errors.Is(err, errNotOurs) {
		return "", err
	}
	if dir, err := recordedCacheDir(); err == nil {
		return dir, nil
	}
	dir, err := os.MkdirTemp(filepath.Dir(kerndatDir), filepath.Base(kerndatDir)+"-")
	if err != nil {
		return "", fmt.Errorf("%s is someone else's, and no directory beside it: %w", kerndatDir, err)
	}
	if err := ensureKerndatDir(dir); err != nil {
		return "", err
	}
	if err := checkOwnDir(filepath.Dir(kerndatDirRecord()), false); err != nil {
		return "", fmt.Errorf("record the CRIU cache directory %s: %w", dir, err)
	}
	if err := writeFileAtomic(kerndatDirRecord(), []byte(dir+"\n"), 0o600); err != nil {
		return "", fmt.Errorf("record the CRIU cache directory %s: %w", dir, err)
	}
	return dir, nil
}

// recordedCacheDir is the directory kerndatDirRecord names, if the record is
// this user's (in a directory only this user can write) and names a
// directory beside kerndatDir that only this user can write.
func recordedCacheDir() (string, error) {
	rec := kerndatDirRecord()
	if err := checkOwnDir(filepath.Dir(rec), false); err != nil {
		return "", err
	}
	var st unix.Stat_t
	if err := unix.Lstat(rec, &st); err != nil {
		return "", err
	}
	if st.Mode&unix.S_IFMT != unix.S_IFREG || int(st.Uid) != os.Geteuid() || st.Mode&0o022 != 0 {
		return "", fmt.Errorf("%s: not a file only this user can write", rec)
	}
	b, err := os.ReadFile(rec)
	if err != nil {
		return "", err
	}
	dir := strings.TrimSpace(string(b))
	if filepath.Clean(dir) != dir || filepath.Dir(dir) != filepath.Dir(kerndatDir) ||
		!strings.HasPrefix(filepath.Base(dir), filepath.Base(kerndatDir)+"-") {
		return "", fmt.Errorf("%s names %q, not a directory beside %s", rec, dir, kerndatDir)
	}
	if err := checkOwnDir(dir, true); err != nil {
		return "", err
	}
	return dir, nil
}

// ensureKerndatDir makes dir (root-only, on a tmpfs) or checks that the one
// there is such: CRIU trusts what it reads from the cache (vDSO symbol
// offsets among others), so nobody but root may write there. Any other
// thing at that path is errNotOurs.
func ensureKerndatDir(dir string) error {
	if tmpfs, err := isTmpfs(filepath.Dir(dir)); err != nil {
		return err
	} else if !tmpfs {
		return fmt.Errorf("%s is not on a tmpfs: a cache there would outlive a reboot", dir)
	}
	if err := os.Mkdir(dir, 0o700); err != nil && !errors.Is(err, os.ErrExist) {
		return err
	}
	return checkOwnDir(dir, true)
}

// checkOwnDir checks that dir, not followed if it is a link, is a directory
// of this user that nobody else can write (private: nobody else may even
// read it).
func checkOwnDir(dir string, private bool) error {
	var st unix.Stat_t
	if err := unix.Lstat(dir, &st); err != nil {
		return err
	}
	perm := uint32(0o022)
	if private {
		perm = 0o077
	}
	if st.Mode&unix.S_IFMT != unix.S_IFDIR || int(st.Uid) != os.Geteuid() || st.Mode&perm != 0 {
		return fmt.Errorf("%s: %w (uid %d)", dir, errNotOurs, os.Geteuid())
	}
	return nil
}

// kerndatName names the kernel-feature cache of the criu binary at path on
// this boot: after the boot and the binary's identity, so an upgraded CRIU
// gets its own.
func kerndatName(criu string) (string, error) {
	return criuproxy.CacheName(criu, ".kdat")
}

// makeKerndat runs the helper in a new mount namespace and returns the cache
// it wrote.
func makeKerndat(self string) ([]byte, error) {
	cmd := exec.Command(self, HookArg, kerndatHelperArg)
	// Go makes the new namespace's mounts private before the helper runs.
	cmd.SysProcAttr = &syscall.SysProcAttr{Unshareflags: syscall.CLONE_NEWNS}
	var out, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &stderr
	if err := cmd.Run(); err != nil && !reapedElsewhere(err) {
		return nil, fmt.Errorf("make CRIU's kernel-feature cache: %w: %s", err, bytes.TrimSpace(stderr.Bytes()))
	}
	b := out.Bytes()
	if len(b) < 8 || binary.LittleEndian.Uint32(b) != kdatMagic {
		return nil, fmt.Errorf("make CRIU's kernel-feature cache: criu wrote none (%d bytes): %s", len(b), bytes.TrimSpace(stderr.Bytes()))
	}
	return b, nil
}

// hwbreakHelperArg is RunHook's subcommand that probes the host's hardware
// breakpoints (hwbreak.Probe) and prints "ok" or "broken". A helper process:
// the shim's reaper, which waits for any child, would take the probe's.
const hwbreakHelperArg = "hwbreak"

// hwbreakCacheName holds the helper's answer in the CRIU cache directory
// (criuCacheDir, emptied by a reboot): a shim probes once per boot.
const hwbreakCacheName = "hwbreak"

// setCRIUBreakpoints sets CRIU_FAULT=130 (hwbreak) for every CRIU run of this
// shim when the host's breakpoints do not trap, or when its helper gives no
// answer, unless CRIU_FAULT is set already; it reports whether it set it,
// and err what went wrong on the way (the cache, the helper).
func setCRIUBreakpoints(self string) (bool, error) {
	if os.Getenv(hwbreak.CRIUFault) != "" {
		return false, nil
	}
	valid := func(b []byte) bool { return string(b) == "ok\n" || string(b) == "broken\n" }
	var answer []byte
	cache := ""
	dir, err := criuCacheDir()
	if err == nil {
		cache = filepath.Join(dir, hwbreakCacheName)
		answer, _ = os.ReadFile(cache)
	}
	if !valid(answer) {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		cmd := exec.CommandContext(ctx, self, HookArg, hwbreakHelperArg)
		var stderr bytes.Buffer
		cmd.Stderr = &stderr
		// The shim's reaper may take the helper's exit: its answer counts.
		out, runErr := cmd.Output()
		switch {
		case (runErr == nil || reapedElsewhere(runErr)) && valid(out):
			answer = out
			if cache != "" {
				err = writeFileAtomic(cache, answer, 0o600)
			}
		default:
			// No answer: CRIU without breakpoints (a few more ptrace
			// stops) rather than a hang where they do not trap.
			if runErr == nil {
				runErr = fmt.Errorf("answer %q", out)
			}
			err = errors.Join(err, fmt.Errorf("%w: %s", runErr, bytes.TrimSpace(stderr.Bytes())))
			answer = []byte("broken\n")
		}
	}
	if string(answer) != "broken\n" {
		return false, err
	}
	return true, errors.Join(err, os.Setenv(hwbreak.CRIUFault, hwbreak.NoBreakpoints))
}

// runHwbreakHelper is the helper: the probe's answer on stdout.
func runHwbreakHelper() error {
	ok, err := hwbreak.Probe()
	if err != nil {
		return err
	}
	answer := "ok\n"
	if !ok {
		answer = "broken\n"
	}
	_, err = os.Stdout.WriteString(answer)
	return err
}

// runKerndatHelper is the helper (in its own mount namespace): a fresh tmpfs
// on /run, where `criu check` saves the cache, which goes to stdout.
func runKerndatHelper() error {
	const runDir = "/run" // CRIU's KDAT_RUNDIR, whatever kerndatLink says
	if err := unix.Mount("lazyfork-kdat", runDir, "tmpfs", unix.MS_NOSUID|unix.MS_NODEV, "mode=0755,size=1m"); err != nil {
		return fmt.Errorf("mount a tmpfs on %s: %w", runDir, err)
	}
	// Any command starts with the probes; this feature check is a short one.
	cmd := exec.Command("criu", "check", "--feature", "mnt_id", "-v0")
	cmd.Stdout, cmd.Stderr = os.Stderr, os.Stderr
	_ = cmd.Run() // a missing feature is no matter: the cache is written first
	b, err := os.ReadFile(filepath.Join(runDir, "criu.kdat"))
	if err != nil {
		return fmt.Errorf("criu saved no cache: %w", err)
	}
	_, err = os.Stdout.Write(b)
	return err
}

func isTmpfs(dir string) (bool, error) {
	var fs unix.Statfs_t
	if err := unix.Statfs(dir, &fs); err != nil {
		return false, fmt.Errorf("statfs %s: %w", dir, err)
	}
	return fs.Type == unix.TMPFS_MAGIC, nil
}
