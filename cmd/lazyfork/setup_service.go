//go:build linux

package main

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/containerd/errdefs"
	"github.com/spf13/pflag"
	"golang.org/x/sys/unix"

	"github.com/lazyfork/lazyfork/api"
	"github.com/lazyfork/lazyfork/internal/procfs"
)

// How setup runs LazyFork's daemons. Where systemd is PID 1 (and the node's own
// containerd is configured) the snapshotter is a systemd service,
// lazyfork-snapshotter.service (deploy/systemd, installed by `make install`),
// and containerd's own unit gets LazyFork's environment from a drop-in
// (containerd.service.d/lazyfork.conf). Elsewhere setup starts each daemon
// under `lazyfork supervise`, which restarts it when it dies, in a cgroup of
// its own (cgroup root/lazyfork/<stack>/<daemon>) rather than the caller's: the
// memory the daemons (and the shims containerd starts) use is charged there.

const (
	cgroupFS        = "/sys/fs/cgroup"
	snapshotterUnit = "lazyfork-snapshotter.service"
	containerdUnit  = "containerd.service"
	fsImmutableFL   = 0x00000010 // FS_IMMUTABLE_FL (chattr +i), which memory files carry
)

func init() {
	var pidFile, cgroup string
	register(&command{
		name:   "supervise",
		args:   "[--child-pidfile FILE] [--cgroup PATH] -- BINARY [ARGS...]",
		short:  "run a daemon, restarting it whenever it dies (how setup runs daemons without systemd)",
		hidden: true,
		example: `  lazyfork supervise --child-pidfile /run/lazyfork/snapshotter.child.pid --cgroup lazyfork/system/snapshotter -- \
      lazyfork-snapshotter --root /var/lib/lazyfork/snapshotter --address /run/lazyfork/snapshotter.sock
SIGTERM stops the daemon (SIGKILL after 20 s) and the supervisor.`,
		noConn: true,
		flags: func(fs *pflag.FlagSet) {
			fs.StringVar(&pidFile, "child-pidfile", "", "write the daemon's current pid here")
			fs.StringVar(&cgroup, "cgroup", "", "cgroup (relative to each hierarchy's root) to run in")
		},
		run: func(a *app, fs *pflag.FlagSet, pos, cmd []string) error {
			args := append(pos, cmd...)
			if len(args) == 0 {
				return fmt.Errorf("supervise: no daemon to run: %w", errdefs.ErrInvalidArgument)
			}
			if cgroup != "" {
				if err := joinCgroup(cgroup); err != nil {
					fmt.Fprintf(os.Stderr, "supervise: %v (running in the caller's cgroup)\n", err)
				}
			}
			return supervise(args, pidFile)
		},
	})
}

// supervise runs args until SIGTERM/SIGINT, restarting it when it exits, with
// a back-off from 1 s to 30 s (reset once it has run for a minute).
func supervise(args []string, pidFile string) error {
	sigs := make(chan os.Signal, 1)
	signal.Notify(sigs, syscall.SIGTERM, syscall.SIGINT)
	signal.Ignore(syscall.SIGHUP)
	backoff := time.Second
	logf := func(f string, a ...any) {
		fmt.Fprintf(os.Stderr, "%s supervise: "+f+"\n", append([]any{time.Now().UTC().Format(time.RFC3339)}, a...)...)
	}
	for {
		cmd := exec.Command(args[0], args[1:]...)
		cmd.Stdout, cmd.Stderr = os.Stdout, os.Stderr
		if err := cmd.Start(); err != nil {
			return fmt.Errorf("supervise: start %s: %w", args[0], err)
		}
		if pidFile != "" {
			_ = writePidFile(pidFile, cmd.Process.Pid)
		}
		started := time.Now()
		done := make(chan error, 1)
		go func() { done <- cmd.Wait() }()
		select {
		case sig := <-sigs:
			_ = cmd.Process.Signal(syscall.SIGTERM)
			select {
			case <-done:
			case <-time.After(20 * time.Second):
				_ = cmd.Process.Kill()
				<-done
			}
			if pidFile != "" {
				os.Remove(pidFile)
			}
			logf("%s stopped on %s", filepath.Base(args[0]), sig)
			return nil
		case err := <-done:
			if time.Since(started) > time.Minute {
				backoff = time.Second
			}
			logf("%s (pid %d) exited (%v); restarting in %s", filepath.Base(args[0]), cmd.Process.Pid, err, backoff)
			select {
			case sig := <-sigs:
				logf("stopped on %s", sig)
				return nil
			case <-time.After(backoff):
			}
			backoff = min(2*backoff, 30*time.Second)
		}
	}
}

func writePidFile(path string, pid int) error {
	tmp := path + ".tmp"
	if err := os.WriteFile(tmp, []byte(strconv.Itoa(pid)+"\n"), 0o644); err != nil {
		return err
	}
	return os.Rename(tmp, path)
}

func readPidFile(path string) int {
	b, err := os.ReadFile(path)
	if err != nil {
		return 0
	}
	pid, _ := strconv.Atoi(strings.TrimSpace(string(b)))
	return pid
}

// stackCgroup is the cgroup (relative to a hierarchy's root) of the stack
// whose LazyFork root is root: lazyfork/system for the default root,
// lazyfork/stack-<hash of root> for a private one.
func stackCgroup(root string) string {
	if root == api.DefaultRoot {
		return "lazyfork/system"
	}
	sum := sha256.Sum256([]byte(root))
	return "lazyfork/stack-" + hex.EncodeToString(sum[:6])
}

// cgroupHierarchies are the roots a process joins: the unified hierarchy, or
// every cgroup v1 hierarchy except cpuset (whose new groups start without CPUs)
// and the unified one of a hybrid setup.
func cgroupHierarchies() []string {
	var out []string
	for _, h := range cgroupRoots() {
		if name := filepath.Base(h); name != "unified" && name != "cpuset" {
			out = append(out, h)
		}
	}
	return out
}

func isCgroup2(p string) bool {
	var st unix.Statfs_t
	return unix.Statfs(p, &st) == nil && st.Type == unix.CGROUP2_SUPER_MAGIC
}

// joinCgroup moves the calling process into rel in every hierarchy.
func joinCgroup(rel string) error {
	hs := cgroupHierarchies()
	if len(hs) == 0 {
		return fmt.Errorf("no cgroup hierarchy under %s: %w", cgroupFS, errdefs.ErrNotFound)
	}
	var errs []error
	for _, h := range hs {
		d := filepath.Join(h, rel)
		if err := os.MkdirAll(d, 0o755); err != nil {
			errs = append(errs, err)
			continue
		}
		if h == cgroupFS && isCgroup2(h) {
			// Memory and pids accounted in the stack's own groups: enable
			// the controllers from the top down to the leaf's parent (errors
			// ignored: a controller the root does not delegate stays off).
			var parents []string
			for p := filepath.Dir(d); len(p) > len(h); p = filepath.Dir(p) {
				parents = append([]string{p}, parents...)
			}
			for _, p := range parents {
				_ = os.WriteFile(filepath.Join(p, "cgroup.subtree_control"), []byte("+memory +pids"), 0o644)
			}
		}
		if err := os.WriteFile(filepath.Join(d, "cgroup.procs"), []byte("0"), 0o644); err != nil {
			errs = append(errs, fmt.Errorf("join cgroup %s: %w", d, err))
		}
	}
	return errors.Join(errs...)
}

// cgroupRoots are the hierarchies a stack's cgroups may be in: those its
// daemons join, and cpuset and a hybrid setup's unified one, where runc
// makes the groups of the stack's containers (and their parents) too.
func cgroupRoots() []string {
	if isCgroup2(cgroupFS) {
		return []string{cgroupFS}
	}
	ents, err := os.ReadDir(cgroupFS)
	if err != nil {
		return nil
	}
	var out []string
	for _, e := range ents {
		if e.IsDir() {
			out = append(out, filepath.Join(cgroupFS, e.Name()))
		}
	}
	return out
}

// removeCgroups removes a stack's cgroups that nothing runs in any more
// (deepest first), in every hierarchy; a group still in use stays.
func removeCgroups(stack string) {
	for _, h := range cgroupRoots() {
		base := filepath.Join(h, stack)
		var dirs []string
		_ = filepath.WalkDir(base, func(p string, d os.DirEntry, err error) error {
			if err == nil && d.IsDir() {
				dirs = append(dirs, p)
			}
			return nil
		})
		for i := len(dirs) - 1; i >= 0; i-- {
			_ = unix.Rmdir(dirs[i])
		}
		_ = unix.Rmdir(filepath.Dir(base)) // lazyfork/, when no stack is left
	}
}

// systemdPID1 reports whether systemd runs this machine (sd_booted(3)).
func systemdPID1() bool {
	fi, err := os.Stat("/run/systemd/system")
	return err == nil && fi.IsDir()
}

func systemctl(ctx context.Context, args ...string) (string, error) {
	out, err := exec.CommandContext(ctx, "systemctl", args...).CombinedOutput()
	s := strings.TrimSpace(string(out))
	if err != nil {
		return s, fmt.Errorf("systemctl %s: %v: %s", strings.Join(args, " "), err, s)
	}
	return s, nil
}

func unitLoaded(ctx context.Context, unit string) bool {
	s, err := systemctl(ctx, "show", "-p", "LoadState", "--value", unit)
	return err == nil && s == "loaded"
}

// setupSystemd enables LazyFork's services on a systemd host and starts
// containerd's unit if it is not running. It reports whether containerd must
// be restarted by the user to load the new configuration.
func (a *app) setupSystemd(ctx context.Context, configChanged bool) error {
	if _, err := systemctl(ctx, "daemon-reload"); err != nil {
		return err
	}
	if !unitLoaded(ctx, snapshotterUnit) {
		return fmt.Errorf("%s is not installed: run `make install` (it installs deploy/systemd), then setup again: %w", snapshotterUnit, errdefs.ErrNotFound)
	}
	if _, err := systemctl(ctx, "enable", "--now", snapshotterUnit); err != nil {
		return err
	}
	fmt.Fprintf(a.out, "snapshotter: %s enabled and running (systemctl status %s)\n", snapshotterUnit, snapshotterUnit)
	if !unitLoaded(ctx, containerdUnit) {
		return fmt.Errorf("no %s: install containerd's unit (containerd's containerd.service), then setup again: %w", containerdUnit, errdefs.ErrNotFound)
	}
	if s, _ := systemctl(ctx, "is-active", containerdUnit); s == "active" {
		if configChanged {
			fmt.Fprintf(a.out, "containerd: running; `systemctl restart %s` loads the new configuration (setup does not restart a running containerd)\n", containerdUnit)
		} else {
			fmt.Fprintf(a.out, "containerd: %s running\n", containerdUnit)
		}
		return nil
	}
	if _, err := systemctl(ctx, "enable", "--now", containerdUnit); err != nil {
		return err
	}
	fmt.Fprintf(a.out, "containerd: %s enabled and started\n", containerdUnit)
	return nil
}

// downSystemd stops and disables what setupSystemd enabled; containerd's own
// unit keeps running (without LazyFork's configuration after its restart).
func (a *app) downSystemd(ctx context.Context) error {
	if !unitLoaded(ctx, snapshotterUnit) {
		return nil
	}
	if _, err := systemctl(ctx, "disable", "--now", snapshotterUnit); err != nil {
		return err
	}
	fmt.Fprintf(a.out, "snapshotter: %s stopped and disabled\n", snapshotterUnit)
	fmt.Fprintf(a.out, "containerd: `systemctl restart %s` drops LazyFork's configuration\n", containerdUnit)
	return nil
}

// lazyforkShims lists the LazyFork shims serving containerd at address: the
// daemons run containerd-shim-lazyfork-v1-full (shims started before the
// front binary existed run containerd-shim-lazyfork-v1).
func lazyforkShims(address string) []int {
	var pids []int
	for _, p := range procfs.Find(func(args []string) bool {
		name := filepath.Base(args[0])
		return (name == "containerd-shim-lazyfork-v1-full" || name == "containerd-shim-lazyfork-v1") && procfs.HasArg(args, address, "-address", "--address")
	}) {
		pids = append(pids, p.PID)
	}
	return pids
}

// purge removes a stack's state, logs and LazyFork root (its tmpfs): only
// once no shim of it runs (they hold the memory files).
func (a *app) purge(o setupOpts) error {
	if pids := lazyforkShims(a.g.address); len(pids) > 0 {
		return fmt.Errorf("--purge: %d LazyFork shims of %s still run (pids %v): delete their containers (lazyfork delete), then --down --purge again: %w",
			len(pids), a.g.address, pids, errdefs.ErrFailedPrecondition)
	}
	var errs []error
	for _, d := range []string{o.state, o.logs, shimSocketDir(o.state)} {
		if _, err := os.Lstat(d); errors.Is(err, os.ErrNotExist) {
			continue
		}
		if err := os.RemoveAll(d); err != nil {
			errs = append(errs, err)
		} else {
			fmt.Fprintf(a.out, "purge: removed %s\n", d)
		}
	}
	_ = unix.Rmdir("/run/lazyfork-shims") // when no stack uses it any more
	if err := removeRoot(a.g.root); err != nil {
		errs = append(errs, err)
	} else {
		fmt.Fprintf(a.out, "purge: removed %s (and its tmpfs)\n", a.g.root)
	}
	return errors.Join(errs...)
}

// removeRoot unmounts everything under the LazyFork root (its tmpfs, deepest
// first), clears the immutable flag memory files carry and removes it.
func removeRoot(root string) error {
	ms, err := procfs.Mounts()
	if err != nil {
		return err
	}
	var mounts []string
	for _, m := range ms {
		if m.Point == root || strings.HasPrefix(m.Point, root+"/") {
			mounts = append(mounts, m.Point)
		}
	}
	for i := len(mounts) - 1; i >= 0; i-- {
		if err := unix.Unmount(mounts[i], unix.MNT_DETACH); err != nil && !errors.Is(err, unix.EINVAL) {
			return fmt.Errorf("unmount %s: %w", mounts[i], err)
		}
	}
	if err := os.RemoveAll(root); err == nil {
		return nil
	}
	// Memory files left on a root that was no tmpfs of its own are immutable.
	_ = filepath.Walk(root, func(p string, info os.FileInfo, err error) error {
		if err == nil && info.Mode().IsRegular() {
			clearImmutable(p)
		}
		return nil
	})
	return os.RemoveAll(root)
}

func clearImmutable(p string) {
	f, err := os.Open(p)
	if err != nil {
		return
	}
	defer f.Close()
	flags, err := unix.IoctlGetUint32(int(f.Fd()), unix.FS_IOC_GETFLAGS)
	if err != nil || flags&fsImmutableFL == 0 {
		return
	}
	_ = unix.IoctlSetPointerInt(int(f.Fd()), unix.FS_IOC_SETFLAGS, int(flags&^fsImmutableFL))
}
