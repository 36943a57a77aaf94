package criurun

import (
	"errors"
	"fmt"
	"os"
	"os/exec"
	"syscall"
	"time"

	"github.com/containerd/errdefs"
	"golang.org/x/sys/unix"

	"github.com/lazyfork/lazyfork/internal/procfs"
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
			if !procfs.Alive(pid) {
				return nil
			}
		}
		time.Sleep(5 * time.Millisecond)
	}
	return fmt.Errorf("kill %d: still there after 10 s", pid)
}
