//go:build linux

package main

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"syscall"
	"time"

	containerd "github.com/containerd/containerd/v2/client"
	"github.com/containerd/errdefs"
	"github.com/spf13/pflag"

	"github.com/lazyfork/lazyfork/internal/hwbreak"
	"github.com/lazyfork/lazyfork/internal/procfs"
	"github.com/lazyfork/lazyfork/memfile"
	snapclient "github.com/lazyfork/lazyfork/snapshotter/client"
)

const defaultConfig = "/etc/containerd/config.toml"

type setupOpts struct {
	config, state, logs         string
	print, noStart, down, purge bool
}

func init() {
	var o setupOpts
	register(&command{
		name:  "setup",
		args:  "[--config FILE] [--state DIR] [--logs DIR] [--print] [--no-start] [--down [--purge]]",
		short: "configure containerd for LazyFork (runtime + snapshotter proxy plugin) and start what is missing",
		example: `  lazyfork setup --print      # show the files setup would write, change nothing
  lazyfork setup              # /etc/containerd/conf.d/lazyfork.toml (imported by config.toml),
                              # start the snapshotter (and containerd if it is not running)
  lazyfork --address /tmp/lf/c.sock --root /tmp/lf/root setup --config /tmp/lf/config.toml --state /tmp/lf/state
                              # a private stack that leaves the system's containerd alone
  lazyfork --address /tmp/lf/c.sock --root /tmp/lf/root setup --config /tmp/lf/config.toml --down
                              # stop what setup started, remove what it wrote
  lazyfork setup --down --purge                  # ... and the state, logs and memory files
LazyFork's containerd configuration is a drop-in, conf.d/lazyfork.toml beside the
config file, in containerd's own config version, reached through config.toml's
imports: setup adds the import (or creates config.toml) when it is missing, never
repeats an entry the configuration already has (proxy_plugins.lazyfork, the CRI
handler lazyfork), and checks the result with containerd config dump. The CRI
handler lets lazyfork.io/* annotations through (pods annotated fork-of need it).
A config file other than the default gets a full private config (root, state and
sockets under --state, CRI disabled). Idempotent: a second run changes nothing.
Daemons: where systemd is PID 1, the node's setup enables lazyfork-snapshotter.service
(installed by make install, with a drop-in giving containerd.service LazyFork's
environment). Otherwise, and for private stacks, setup starts the snapshotter (and
containerd when none answers) under "lazyfork supervise", which restarts a daemon
that dies, each in a cgroup of its own (lazyfork/<stack>/<daemon> in every
hierarchy), not the caller's; logs in --logs, pidfiles in the LazyFork root.`,
		noConn: true,
		flags: func(fs *pflag.FlagSet) {
			fs.StringVar(&o.config, "config", defaultConfig, "containerd config file")
			fs.StringVar(&o.state, "state", "/var/lib/lazyfork", "LazyFork state: snapshotter layers (and containerd's root for a private config)")
			fs.StringVar(&o.logs, "logs", "/var/log/lazyfork", "daemon logs")
			fs.BoolVar(&o.print, "print", false, "print the config, change nothing")
			fs.BoolVar(&o.noStart, "no-start", false, "write the config only")
			fs.BoolVar(&o.down, "down", false, "undo setup: stop the daemons it started (or disable its systemd unit), remove the drop-in (and a config.toml it created)")
			fs.BoolVar(&o.purge, "purge", false, "with --down: also remove --state, --logs and the LazyFork root (its tmpfs and memory files)")
		},
		run: func(a *app, fs *pflag.FlagSet, pos, _ []string) error {
			if err := needArgs(pos, 0, "no arguments"); err != nil {
				return err
			}
			return a.setup(o)
		},
	})
}

func (a *app) snapshotterAddress(o setupOpts) string {
	return filepath.Join(a.g.root, "snapshotter.sock")
}

func (a *app) setup(o setupOpts) error {
	for _, p := range []*string{&o.config, &o.state, &o.logs, &a.g.root} {
		if abs, err := filepath.Abs(*p); err == nil {
			*p = abs
		}
	}
	if o.purge && !o.down {
		return fmt.Errorf("--purge goes with --down: %w", errdefs.ErrInvalidArgument)
	}
	private := o.config != defaultConfig
	useSystemd := !private && systemdPID1()
	if o.down {
		return a.setupDown(o, useSystemd)
	}
	containerdBin := findBin("", "containerd")
	plan, err := a.planConfig(o, private, containerdConfigVersion(containerdBin))
	if err != nil {
		return err
	}
	if o.print {
		plan.print(a)
		return nil
	}
	changed, err := plan.apply(a)
	if err != nil {
		return err
	}
	if isExec(containerdBin) {
		if err := plan.verify(containerdBin); err != nil {
			return err
		}
	}
	if o.noStart {
		return nil
	}
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	if useSystemd {
		return a.setupSystemd(ctx, changed)
	}
	if err := memfile.EnsureTmpfs(a.g.root, halfOfRAM()); err != nil {
		return err
	}
	if err := os.MkdirAll(o.logs, 0o755); err != nil {
		return err
	}
	self, _ := os.Executable()
	binDir := filepath.Dir(self)
	stack := stackCgroup(a.g.root)

	snAddr := a.snapshotterAddress(o)
	if snapshotterUp(ctx, snAddr) {
		fmt.Fprintf(a.out, "snapshotter: running at %s\n", snAddr)
	} else {
		bin := findBin(binDir, "lazyfork-snapshotter")
		pid, err := a.startDaemon("snapshotter", stack, bin, []string{"--root", filepath.Join(o.state, "snapshotter"), "--address", snAddr, "--lazyfork-root", a.g.root}, nil, o.logs)
		if err != nil {
			return fmt.Errorf("start lazyfork-snapshotter: %w", err)
		}
		for !snapshotterUp(ctx, snAddr) {
			if ctx.Err() != nil || !procfs.Alive(pid) {
				return fmt.Errorf("lazyfork-snapshotter (supervisor pid %d) does not answer at %s; see %s", pid, snAddr, filepath.Join(o.logs, "snapshotter.log"))
			}
			time.Sleep(100 * time.Millisecond)
		}
		fmt.Fprintf(a.out, "snapshotter: started (supervisor pid %d, cgroup %s/snapshotter) at %s, log %s\n", pid, stack, snAddr, filepath.Join(o.logs, "snapshotter.log"))
	}

	if v, ok := containerdUp(ctx, a.g.address); ok {
		fmt.Fprintf(a.out, "containerd: %s running at %s\n", v, a.g.address)
		if changed {
			fmt.Fprintf(a.out, "containerd: restart it to load the new config (setup does not restart a running containerd)\n")
		}
		return nil
	}
	env := append(os.Environ(), "PATH="+binDir+":"+os.Getenv("PATH"), "LAZYFORK_ROOT="+a.g.root)
	// Every runtime's CRIU (runc.v2's too) hangs where the host's
	// breakpoints do not trap; the LazyFork shim checks for itself.
	env = hwbreak.CRIUEnv(env)
	if private {
		// Nothing of runc's state or of the containers' cgroups is shared
		// with another stack (shim/config.go).
		env = append(env, "LAZYFORK_RUNC_ROOT="+filepath.Join(o.state, "runc"),
			"LAZYFORK_CGROUP_PARENT=/"+stack+"/containers")
	}
	pid, err := a.startDaemon("containerd", stack, containerdBin, []string{"--config", o.config}, env, o.logs)
	if err != nil {
		return fmt.Errorf("start containerd: %w", err)
	}
	for {
		if v, ok := containerdUp(ctx, a.g.address); ok {
			fmt.Fprintf(a.out, "containerd: %s started (supervisor pid %d, cgroup %s/containerd) at %s, log %s\n", v, pid, stack, a.g.address, filepath.Join(o.logs, "containerd.log"))
			return nil
		}
		if ctx.Err() != nil || !procfs.Alive(pid) {
			return fmt.Errorf("containerd (supervisor pid %d) does not answer at %s; see %s", pid, a.g.address, filepath.Join(o.logs, "containerd.log"))
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// setupDown undoes setup: it stops the daemons whose pidfiles setup wrote
// (containerd first) or disables the systemd unit it enabled, removes the
// configuration setup wrote and the stack's cgroups, and with --purge the
// state, logs and LazyFork root.
func (a *app) setupDown(o setupOpts, useSystemd bool) error {
	var errs []error
	for _, name := range []string{"containerd", "snapshotter"} {
		pf := filepath.Join(a.g.root, name+".pid")
		child := filepath.Join(a.g.root, name+".child.pid")
		pid := readPidFile(pf)
		if pid > 1 && procfs.Alive(pid) {
			stopPid(pid, 25*time.Second)
			fmt.Fprintf(a.out, "%s: stopped (pid %d)\n", name, pid)
		}
		// A supervisor that died leaves its daemon running.
		if c := readPidFile(child); c > 1 && procfs.Alive(c) {
			stopPid(c, 20*time.Second)
			fmt.Fprintf(a.out, "%s: stopped (pid %d)\n", name, c)
		}
		os.Remove(pf)
		os.Remove(child)
	}
	if useSystemd {
		ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
		defer cancel()
		if err := a.downSystemd(ctx); err != nil {
			errs = append(errs, err)
		}
	}
	if err := a.removeConfig(o.config); err != nil {
		errs = append(errs, err)
	}
	removeCgroups(stackCgroup(a.g.root))
	if o.purge {
		if err := a.purge(o); err != nil {
			errs = append(errs, err)
		}
	}
	return errors.Join(errs...)
}

func stopPid(pid int, grace time.Duration) {
	_ = syscall.Kill(pid, syscall.SIGTERM)
	deadline := time.Now().Add(grace)
	for procfs.Alive(pid) && time.Now().Before(deadline) {
		time.Sleep(100 * time.Millisecond)
	}
	if procfs.Alive(pid) {
		_ = syscall.Kill(pid, syscall.SIGKILL)
	}
}

func findBin(dir, name string) string {
	if dir != "" {
		if p := filepath.Join(dir, name); isExec(p) {
			return p
		}
	}
	if p, err := exec.LookPath(name); err == nil {
		return p
	}
	return name
}

func isExec(p string) bool {
	fi, err := os.Stat(p)
	return err == nil && fi.Mode()&0o111 != 0
}

// startDaemon runs bin under `lazyfork supervise` (restarted when it dies),
// in its own session and in the cgroup stack/name, output to logs/name.log; the
// supervisor's pid goes to ROOT/name.pid, the daemon's to ROOT/name.child.pid.
func (a *app) startDaemon(name, stack, bin string, args, env []string, logs string) (int, error) {
	logPath := filepath.Join(logs, name+".log")
	logf, err := os.OpenFile(logPath, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		return 0, err
	}
	defer logf.Close()
	self, err := os.Executable()
	if err != nil {
		return 0, err
	}
	sup := append([]string{"supervise", "--child-pidfile", filepath.Join(a.g.root, name+".child.pid"),
		"--cgroup", stack + "/" + name, "--", bin}, args...)
	cmd := exec.Command(self, sup...)
	cmd.Env = env
	cmd.Stdout, cmd.Stderr = logf, logf
	cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true}
	if err := cmd.Start(); err != nil {
		return 0, err
	}
	pid := cmd.Process.Pid
	_ = cmd.Process.Release()
	return pid, writePidFile(filepath.Join(a.g.root, name+".pid"), pid)
}

func snapshotterUp(ctx context.Context, addr string) bool {
	if _, err := os.Stat(addr); err != nil {
		return false
	}
	c, err := snapclient.Dial(ctx, snapclient.TTRPCAddress(addr))
	if err != nil {
		return false
	}
	c.Close()
	return true
}

func containerdUp(ctx context.Context, addr string) (string, bool) {
	if _, err := os.Stat(addr); err != nil {
		return "", false
	}
	cd, err := containerd.New(addr, containerd.WithTimeout(2*time.Second))
	if err != nil {
		return "", false
	}
	defer cd.Close()
	v, err := cd.Version(ctx)
	if err != nil {
		return "", false
	}
	return v.Version, true
}

func halfOfRAM() int64 {
	total, _ := procfs.MemInfo("MemTotal")
	return total / 2
}
