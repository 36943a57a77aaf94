package hwbreak

import (
	"errors"
	"fmt"
	"os"
	"os/exec"
	"runtime"
	"syscall"
	"time"

	"golang.org/x/sys/unix"
)

// Offsets in x86-64's struct user of u_debugreg[0] (DR0, an address) and
// u_debugreg[7] (DR7, the control register).
const (
	offDR0 = 848
	offDR7 = offDR0 + 7*8
)

// Probe reports whether an execution breakpoint set through ptrace traps on
// this host; err says why the probe itself failed (CRIUEnv and SetCRIUEnv
// then turn CRIU's breakpoints off all the same). It starts `true` traced, stopped at its first
// instruction after exec, puts an execution breakpoint (DR0, enabled locally
// in DR7) on that very instruction and lets it go: where breakpoints work the
// task traps at once (SIGTRAP, before running anything); where they do not
// it runs to its exit. It waits for its child by pid: in a process that reaps
// every child (a containerd shim), run it in a helper process instead.
func Probe() (bool, error) {
	prog, err := exec.LookPath("true")
	if err != nil {
		return true, fmt.Errorf("breakpoint probe: %w", err)
	}
	// Every ptrace request of a tracee comes from the thread that traced it.
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	null, err := os.Open(os.DevNull)
	if err != nil {
		return true, err
	}
	defer null.Close()
	pid, err := syscall.ForkExec(prog, []string{"true"}, &syscall.ProcAttr{
		Files: []uintptr{null.Fd(), null.Fd(), null.Fd()},
		Sys:   &syscall.SysProcAttr{Ptrace: true, Pdeathsig: syscall.SIGKILL},
	})
	if err != nil {
		return true, fmt.Errorf("breakpoint probe: start %s: %w", prog, err)
	}
	// Polled, and bounded: a reaper elsewhere in this process taking the
	// child's events must not hang the caller. Once the child is reaped
	// (here or elsewhere) its pid is never signalled again.
	gone := false
	wait := func() (unix.WaitStatus, error) {
		deadline := time.Now().Add(2 * time.Second)
		for {
			var ws unix.WaitStatus
			got, err := unix.Wait4(pid, &ws, unix.WALL|unix.WNOHANG, nil)
			switch {
			case err == unix.EINTR:
				continue
			case err != nil:
				gone = gone || err == unix.ECHILD
				return ws, err
			case got == pid:
				gone = ws.Exited() || ws.Signaled()
				return ws, nil
			case time.Now().After(deadline):
				return ws, errors.New("no news of the child in 2 s (does this process reap every child?)")
			}
			time.Sleep(100 * time.Microsecond)
		}
	}
	defer func() {
		if gone {
			return
		}
		unix.Kill(pid, unix.SIGKILL)
		for !gone {
			if _, err := wait(); err != nil {
				return
			}
		}
	}()
	stop := wait
	ws, err := stop() // the exec's SIGTRAP
	if err != nil || !ws.Stopped() || ws.StopSignal() != unix.SIGTRAP {
		return true, fmt.Errorf("breakpoint probe: %s did not stop after exec (%v, %v)", prog, ws, err)
	}
	var regs unix.PtraceRegs
	if err := unix.PtraceGetRegs(pid, &regs); err != nil {
		return true, fmt.Errorf("breakpoint probe: %w", err)
	}
	poke := func(off, val uintptr) error {
		_, _, e := unix.Syscall6(unix.SYS_PTRACE, unix.PTRACE_POKEUSR, uintptr(pid), off, val, 0, 0)
		if e != 0 {
			return e
		}
		return nil
	}
	if err := poke(offDR0, uintptr(regs.Rip)); err != nil {
		return true, fmt.Errorf("breakpoint probe: set DR0: %w", err)
	}
	if err := poke(offDR7, 1); err != nil { // L0: DR0 on, an execution breakpoint
		return true, fmt.Errorf("breakpoint probe: set DR7: %w", err)
	}
	if err := unix.PtraceCont(pid, 0); err != nil {
		return true, fmt.Errorf("breakpoint probe: %w", err)
	}
	ws, err = stop()
	switch {
	case err != nil:
		return true, fmt.Errorf("breakpoint probe: %w", err)
	case ws.Stopped() && ws.StopSignal() == unix.SIGTRAP:
		return true, nil
	case ws.Exited():
		return false, nil
	}
	return true, fmt.Errorf("breakpoint probe: %s neither trapped nor exited (%v)", prog, ws)
}
