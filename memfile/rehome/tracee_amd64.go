//go:build linux && amd64

package rehome

import (
	"bufio"
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"os"
	"slices"
	"strconv"
	"strings"
	"unsafe"

	"github.com/containerd/errdefs"
	"golang.org/x/sys/unix"

	"github.com/lazyfork/lazyfork/internal/freezer"
)

func supported() error { return nil }

// proc is one seized process.
type proc struct {
	pid     int
	tids    []int // seized threads
	inj     int   // the thread system calls are injected into
	saved   unix.PtraceRegs
	mask    uint64 // inj's blocked signals before injection
	sysAddr uint64 // address of a `syscall` instruction in the vDSO
	stopSig int    // the process was group-stopped by this signal
	mem     *os.File

	injected bool // inj has run an injected call: its registers need restoring
	dead     bool // the process died under us

	batchAt  uint64 // the batch stub's mapping in the process (0: none yet)
	batchOff bool   // no batches for this process (switched off, SIGTRAP ignored, or the stub refused)

	pending map[int]unix.WaitStatus // statuses taken while waiting for another thread (shared by a Tracee's procs)
}

const (
	ptraceGetSigmask = 0x420a
	ptraceSetSigmask = 0x420b
	eventShift       = 16
)

func ptraceRaw(req, pid int, addr, data uintptr) error {
	_, _, e := unix.Syscall6(unix.SYS_PTRACE, uintptr(req), uintptr(pid), addr, data, 0, 0)
	if e != 0 {
		return e
	}
	return nil
}

// wait returns the next wait status of thread tid. It waits for any
// tracee of the tracer thread (__WNOTHREAD: not the caller's other
// children) and keeps the others' statuses for later: a leader's exit is
// only reported once its other threads are reaped, so waiting for the
// leader alone could hang if the process is killed meanwhile.
func (p *proc) wait(tid int) (unix.WaitStatus, error) {
	if ws, ok := p.pending[tid]; ok {
		delete(p.pending, tid)
		return ws, nil
	}
	for {
		var ws unix.WaitStatus
		wpid, err := unix.Wait4(-1, &ws, unix.WALL|unix.WNOTHREAD, nil)
		if err == unix.EINTR {
			continue
		}
		if err != nil {
			return ws, err
		}
		if wpid == tid {
			return ws, nil
		}
		p.pending[wpid] = ws
	}
}

func isStopSig(s unix.Signal) bool {
	return s == unix.SIGSTOP || s == unix.SIGTSTP || s == unix.SIGTTIN || s == unix.SIGTTOU
}

func seccompMode(pid int) int {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		return 0
	}
	for l := range strings.SplitSeq(string(b), "\n") {
		if v, ok := strings.CutPrefix(l, "Seccomp:"); ok {
			n, _ := strconv.Atoi(strings.TrimSpace(v))
			return n
		}
	}
	return 0
}

func (t *Tracee) seize(pids []int) (err error) {
	defer func() {
		if err != nil {
			t.abort()
		}
	}()
	for _, pid := range pids {
		if t.procs[pid] != nil {
			continue
		}
		if t.pending == nil {
			t.pending = map[int]unix.WaitStatus{}
		}
		p := &proc{pid: pid, pending: t.pending}
		t.procs[pid] = p
		t.order = append(t.order, pid)
		opts := unix.PTRACE_O_TRACESYSGOOD
		if seccompMode(pid) != 0 {
			// Injected calls must not meet the process's own filters.
			opts |= unix.PTRACE_O_SUSPEND_SECCOMP
		}
		seized := map[int]bool{}
		// Re-list until no new thread appears: a thread not yet
		// interrupted may start another.
		for {
			tids, err := listTasks(pid)
			if err != nil {
				return err
			}
			fresh := false
			for _, tid := range tids {
				if seized[tid] {
					continue
				}
				if err := ptraceRaw(unix.PTRACE_SEIZE, tid, 0, uintptr(opts)); err != nil {
					if err == unix.ESRCH {
						continue // exited meanwhile
					}
					return fmt.Errorf("rehome: process %d: seize thread %d: %w", pid, tid, errors.Join(err, errdefs.ErrFailedPrecondition))
				}
				seized[tid] = true
				p.tids = append(p.tids, tid)
				fresh = true
				if err := unix.PtraceInterrupt(tid); err != nil && err != unix.ESRCH {
					return fmt.Errorf("rehome: process %d: interrupt thread %d: %w", pid, tid, err)
				}
			}
			if !fresh {
				break
			}
		}
	}
	if t.cgroup != "" {
		if err := freezer.Set(t.cgroup, false); err != nil {
			return err
		}
	}
	for _, pid := range t.order {
		p := t.procs[pid]
		var live []int
		for _, tid := range p.tids {
			ok, err := p.waitSeized(tid)
			if err != nil {
				return err
			}
			if ok {
				live = append(live, tid)
			}
		}
		p.tids = live
		if err := p.prepare(); err != nil {
			return err
		}
	}
	return nil
}

// waitSeized waits for a freshly seized thread's interrupt stop. It reports
// false if the thread exited.
func (p *proc) waitSeized(tid int) (bool, error) {
	for {
		ws, err := p.wait(tid)
		if err != nil {
			return false, fmt.Errorf("rehome: process %d: wait for thread %d: %w", p.pid, tid, err)
		}
		if ws.Exited() || ws.Signaled() {
			return false, nil
		}
		if !ws.Stopped() {
			continue
		}
		sig := ws.StopSignal()
		if int(ws)>>eventShift == unix.PTRACE_EVENT_STOP {
			if sig == unix.SIGTRAP {
				return true, nil // the interrupt stop
			}
			if isStopSig(sig) {
				// The process was stopped by a signal: the thread
				// reports its group stop as a ptrace stop, which
				// serves as well (injected calls run it past the
				// stop; Detach stops the process again).
				p.stopSig = int(sig)
			}
			return true, nil
		}
		// A signal-delivery stop: a stop signal is kept for Detach,
		// any other is delivered (its handler frame is set up before
		// the pending interrupt stops the thread).
		deliver := int(sig)
		if isStopSig(sig) {
			p.stopSig, deliver = int(sig), 0
		}
		if err := unix.PtraceCont(tid, deliver); err != nil {
			return false, fmt.Errorf("rehome: process %d: thread %d: %w", p.pid, tid, err)
		}
	}
}

// prepare picks the thread to inject into, saves its state and finds a
// syscall instruction.
func (p *proc) prepare() error {
	if len(p.tids) == 0 {
		p.dead = true
		return fmt.Errorf("rehome: process %d exited: %w", p.pid, errdefs.ErrNotFound)
	}
	p.inj = p.tids[0]
	for _, tid := range p.tids {
		if tid == p.pid {
			p.inj = tid
		}
	}
	if err := unix.PtraceGetRegs(p.inj, &p.saved); err != nil {
		return fmt.Errorf("rehome: process %d: thread %d: get registers: %w", p.pid, p.inj, err)
	}
	if p.saved.Cs != 0x33 {
		return fmt.Errorf("rehome: process %d runs in 32-bit mode (cs %#x): %w", p.pid, p.saved.Cs, errdefs.ErrNotImplemented)
	}
	if err := ptraceRaw(ptraceGetSigmask, p.inj, 8, uintptr(unsafe.Pointer(&p.mask))); err != nil {
		return fmt.Errorf("rehome: process %d: thread %d: get signal mask: %w", p.pid, p.inj, err)
	}
	mem, err := os.OpenFile(fmt.Sprintf("/proc/%d/mem", p.pid), os.O_RDWR, 0)
	if err != nil {
		return fmt.Errorf("rehome: process %d: %w", p.pid, err)
	}
	p.mem = mem
	addr, err := p.findSyscall()
	if err != nil {
		return err
	}
	p.sysAddr = addr
	return nil
}

// findSyscall returns the address of the bytes 0f 05 (syscall) in the
// process's vDSO, or before the saved rip if the thread sits in a syscall.
func (p *proc) findSyscall() (uint64, error) {
	f, err := os.Open(fmt.Sprintf("/proc/%d/maps", p.pid))
	if err != nil {
		return 0, fmt.Errorf("rehome: process %d: %w", p.pid, err)
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		l := sc.Text()
		if !strings.HasSuffix(l, "[vdso]") {
			continue
		}
		lo, hi, _ := strings.Cut(strings.Fields(l)[0], "-")
		s, _ := strconv.ParseUint(lo, 16, 64)
		e, _ := strconv.ParseUint(hi, 16, 64)
		if e <= s || e-s > 1<<20 {
			break
		}
		b := make([]byte, e-s)
		if _, err := p.mem.ReadAt(b, int64(s)); err != nil {
			break
		}
		if i := bytes.Index(b, []byte{0x0f, 0x05}); i >= 0 {
			return s + uint64(i), nil
		}
	}
	var b [2]byte
	if int64(p.saved.Orig_rax) >= 0 && p.saved.Rip >= 2 {
		if _, err := p.mem.ReadAt(b[:], int64(p.saved.Rip-2)); err == nil && b == [2]byte{0x0f, 0x05} {
			return p.saved.Rip - 2, nil
		}
	}
	return 0, fmt.Errorf("rehome: process %d: no syscall instruction in its vDSO: %w", p.pid, errdefs.ErrNotImplemented)
}

// syscall runs one system call in p's injection thread and returns its raw
// result (-errno on failure). An error means the injection itself failed.
func (p *proc) syscall(nr uintptr, args ...uint64) (int64, error) {
	if p.dead {
		return 0, fmt.Errorf("rehome: process %d is gone: %w", p.pid, errdefs.ErrNotFound)
	}
	var a [6]uint64
	copy(a[:], args)
	regs := p.saved
	regs.Rip = p.sysAddr
	regs.Rax = uint64(nr)
	// orig_rax -1: the kernel's restart logic leaves the injected call
	// alone when it returns from the stop.
	regs.Orig_rax = ^uint64(0)
	regs.Rdi, regs.Rsi, regs.Rdx, regs.R10, regs.R8, regs.R9 = a[0], a[1], a[2], a[3], a[4], a[5]
	if !p.injected {
		// Block every signal while injecting: a signal taken at the
		// injected rip would run its handler there. Pending signals
		// stay pending until the mask is put back.
		all := ^uint64(0)
		if err := ptraceRaw(ptraceSetSigmask, p.inj, 8, uintptr(unsafe.Pointer(&all))); err != nil {
			return 0, fmt.Errorf("rehome: process %d: thread %d: block signals: %w", p.pid, p.inj, err)
		}
		p.injected = true
	}
	if err := unix.PtraceSetRegs(p.inj, &regs); err != nil {
		return 0, fmt.Errorf("rehome: process %d: thread %d: set registers: %w", p.pid, p.inj, err)
	}
	// Two syscall stops: entry, then exit.
	for range 2 {
		if err := p.resumeToSyscallStop(); err != nil {
			return 0, err
		}
	}
	var out unix.PtraceRegs
	if err := unix.PtraceGetRegs(p.inj, &out); err != nil {
		return 0, fmt.Errorf("rehome: process %d: thread %d: get registers: %w", p.pid, p.inj, err)
	}
	// Between calls the thread holds its own registers and signal mask: a
	// tracer killed here leaves a process that runs on where it was, each
	// chunk moved or not (two ptrace calls a syscall, microseconds).
	if err := p.restore(); err != nil {
		return 0, err
	}
	return int64(out.Rax), nil
}

func (p *proc) resumeToSyscallStop() error {
	for {
		if err := unix.PtraceSyscall(p.inj, 0); err != nil {
			return fmt.Errorf("rehome: process %d: thread %d: resume: %w", p.pid, p.inj, err)
		}
		ws, err := p.wait(p.inj)
		if err != nil {
			return fmt.Errorf("rehome: process %d: thread %d: wait: %w", p.pid, p.inj, err)
		}
		switch {
		case ws.Exited() || ws.Signaled():
			p.dead = true
			return fmt.Errorf("rehome: process %d: thread %d died during injection (%v): %w", p.pid, p.inj, ws, errdefs.ErrAborted)
		case !ws.Stopped():
			continue
		case ws.StopSignal() == unix.SIGTRAP|0x80:
			return nil
		case int(ws)>>eventShift == unix.PTRACE_EVENT_STOP || isStopSig(ws.StopSignal()):
			// A stop signal (SIGSTOP cannot be blocked), at its
			// delivery (dropped: resumed with none) or as a group stop:
			// carry on, and stop the process again on Detach.
			if isStopSig(ws.StopSignal()) {
				p.stopSig = int(ws.StopSignal())
			}
			continue
		default:
			// A synchronous signal the mask cannot hold off.
			return fmt.Errorf("rehome: process %d: thread %d: signal %v during injection: %w", p.pid, p.inj, ws.StopSignal(), errdefs.ErrAborted)
		}
	}
}

// restore puts back the injection thread's registers (orig_rax included)
// and signal mask. PTRACE_DETACH then wakes the thread with TIF_SIGPENDING
// set, so it passes through signal handling on its way out, where the
// kernel's restart logic sees the saved orig_rax and rax and restarts an
// interrupted call (rip -= 2, or restart_syscall for a restart block), the
// same path the threads that were only interrupted take.
func (p *proc) restore() error {
	if !p.injected || p.dead {
		return nil
	}
	if err := unix.PtraceSetRegs(p.inj, &p.saved); err != nil {
		return fmt.Errorf("rehome: process %d: thread %d: restore registers: %w", p.pid, p.inj, err)
	}
	if err := ptraceRaw(ptraceSetSigmask, p.inj, 8, uintptr(unsafe.Pointer(&p.mask))); err != nil {
		return fmt.Errorf("rehome: process %d: thread %d: restore signal mask: %w", p.pid, p.inj, err)
	}
	p.injected = false
	return nil
}

func (t *Tracee) detach() error {
	var errs []error
	for _, pid := range t.order {
		if err := t.procs[pid].restore(); err != nil {
			errs = append(errs, err)
		}
	}
	if t.cgroup != "" {
		if err := freezer.Set(t.cgroup, true); err != nil {
			errs = append(errs, err)
		}
	}
	clean := true
	for _, pid := range t.order {
		p := t.procs[pid]
		if p.stopSig != 0 && !p.dead {
			// Stopped before: stopped after (as CRIU's compel does).
			unix.Kill(pid, unix.Signal(p.stopSig))
		}
		for _, tid := range p.tids {
			if err := ptraceRaw(unix.PTRACE_DETACH, tid, 0, 0); err != nil && err != unix.ESRCH {
				errs = append(errs, fmt.Errorf("rehome: process %d: detach thread %d: %w", pid, tid, err))
				clean = false
			}
		}
		if p.mem != nil {
			p.mem.Close()
		}
	}
	t.clean = clean
	return errors.Join(errs...)
}

// abort undoes a partial seize.
func (t *Tracee) abort() {
	for _, pid := range t.order {
		p := t.procs[pid]
		for _, tid := range p.tids {
			ptraceRaw(unix.PTRACE_DETACH, tid, 0, 0)
		}
		if p.mem != nil {
			p.mem.Close()
		}
	}
	if t.cgroup != "" {
		freezer.Set(t.cgroup, true)
	}
}

// errno turns a raw syscall result into an error.
func errno(r int64) error {
	if r < 0 && r > -4096 {
		return unix.Errno(-r)
	}
	return nil
}

func (t *Tracee) proc(pid int) (*proc, error) {
	p := t.procs[pid]
	if p == nil {
		return nil, fmt.Errorf("rehome: process %d is not seized: %w", pid, errdefs.ErrInvalidArgument)
	}
	return p, nil
}

// Remap replaces each VMA of process pid with a MAP_PRIVATE|MAP_FIXED
// mapping of path at the VMA's slot offset, by system calls injected into
// the stopped process: openat(path), one mmap per VMA, close. path is the
// memory file as the process sees it (its mount namespace and root), and
// must hold the VMAs' bytes (CopyPages) taken while the process was
// stopped. It returns the VMAs now mapping the file. A VMA whose mmap fails
// stays as it was (the kernel replaces a mapping only once the new one is
// set up) and its failure is in the returned error; the others are
// converted all the same.
//
// The path is written into the process for openat: over the start of the
// first readable VMA to convert, whose bytes are already in the file (the
// mmap brings them back), and written back if that VMA's mmap fails.
func (t *Tracee) Remap(pid int, path string, vmas []VMA) ([]VMA, error) {
	var done []VMA
	err := t.do(func() error {
		var err error
		done, err = t.remap(pid, path, vmas)
		return err
	})
	return done, err
}

func (t *Tracee) remap(pid int, path string, vmas []VMA) ([]VMA, error) {
	p, err := t.proc(pid)
	if err != nil {
		return nil, err
	}
	if len(vmas) == 0 {
		return nil, nil
	}
	if err := checkVMAs(pid, vmas); err != nil {
		return nil, err
	}
	fd, err := p.open(path, unix.O_RDONLY|unix.O_CLOEXEC, vmas)
	if err != nil {
		return nil, err
	}
	var done []VMA
	var errs []error
	for _, v := range vmas {
		r, err := p.syscall(unix.SYS_MMAP, v.Start, v.Len(), uint64(v.Prot),
			uint64(unix.MAP_PRIVATE|unix.MAP_FIXED|v.Flags), uint64(fd), uint64(v.Offset()))
		if err != nil {
			errs = append(errs, err)
			break
		}
		if e := errno(r); e != nil || uint64(r) != v.Start {
			errs = append(errs, fmt.Errorf("rehome: process %d: map %s over %v at offset %#x: %v (the VMA is unchanged)", pid, path, v, v.Offset(), cmpErr(e, r)))
			continue
		}
		done = append(done, v)
	}
	errs = append(errs, p.close(fd))
	return done, errors.Join(errs...)
}

// open opens path in the process by injection and returns the descriptor.
// The path is written over the start of the first readable VMA of vmas and
// its bytes are put back as soon as the call returns.
func (p *proc) open(path string, flags int, vmas []VMA) (int64, error) {
	if len(path)+1 > pageSize || strings.IndexByte(path, 0) >= 0 {
		return 0, fmt.Errorf("rehome: memory file path %q is not a valid path: %w", path, errdefs.ErrInvalidArgument)
	}
	holder := -1
	for i, v := range vmas {
		if v.Prot&unix.PROT_READ != 0 {
			holder = i
			break
		}
	}
	if holder < 0 {
		return 0, fmt.Errorf("rehome: process %d: no readable VMA to hold the path: %w", p.pid, errdefs.ErrNotImplemented)
	}
	at := vmas[holder].Start
	orig := make([]byte, len(path)+1)
	if _, err := p.mem.ReadAt(orig, int64(at)); err != nil {
		return 0, fmt.Errorf("rehome: process %d: read %#x: %w", p.pid, at, err)
	}
	putBack := func() error {
		if _, err := p.mem.WriteAt(orig, int64(at)); err != nil {
			return fmt.Errorf("rehome: process %d: put back the %d bytes at %#x the path overwrote: %w", p.pid, len(orig), at, errors.Join(err, errdefs.ErrDataLoss))
		}
		return nil
	}
	if _, err := p.mem.WriteAt(append([]byte(path), 0), int64(at)); err != nil {
		return 0, errors.Join(fmt.Errorf("rehome: process %d: write the path at %#x: %w", p.pid, at, err), putBack())
	}
	const atFDCWD = ^uint64(99) // -100
	fd, err := p.syscall(unix.SYS_OPENAT, atFDCWD, at, uint64(flags), 0)
	if err == nil {
		if e := errno(fd); e != nil {
			err = fmt.Errorf("rehome: process %d: open %s: %w", p.pid, path, errors.Join(e, errdefs.ErrNotFound))
		}
	}
	if perr := putBack(); perr != nil {
		if err == nil && fd >= 0 {
			p.syscall(unix.SYS_CLOSE, uint64(fd))
		}
		return 0, errors.Join(err, perr)
	}
	return fd, err
}

func (p *proc) close(fd int64) error {
	r, err := p.syscall(unix.SYS_CLOSE, uint64(fd))
	if err != nil {
		return err
	}
	if e := errno(r); e != nil {
		return fmt.Errorf("rehome: process %d: close fd %d: %w", p.pid, fd, e)
	}
	return nil
}

// CopyPages is the package's CopyPages done by the process itself: it opens
// path (as it sees it) for writing and pwrites each run of pages it holds
// (present, other than the zero page, or swapped) from its own memory into
// the file at the VMA's slot offset. The pages are copied once, and the
// file's pages are charged to the process's own memory cgroup, not to the
// caller's. The file is extended through /proc/pid/root. Runs the process
// cannot pwrite (PROT_NONE memory), or all of them if it may not open the
// file for writing, are copied by the tracer (package CopyPages); Stats
// says how many bytes. Unlike the package's CopyPages, pages of zeros that
// are not the zero page are written.
func (t *Tracee) CopyPages(pid int, path string, vmas []VMA) (CopyStats, error) {
	var st CopyStats
	err := t.do(func() error {
		var err error
		st, err = t.copyPages(pid, path, vmas)
		return err
	})
	return st, err
}

// maxWrite bounds one injected pwrite (the kernel caps a write at 2 GiB).
const maxWrite = 1 << 30

func (t *Tracee) copyPages(pid int, path string, vmas []VMA) (CopyStats, error) {
	var st CopyStats
	p, err := t.proc(pid)
	if err != nil || len(vmas) == 0 {
		return st, err
	}
	if !strings.HasPrefix(path, "/") {
		return st, fmt.Errorf("rehome: memory file path %q is not absolute: %w", path, errdefs.ErrInvalidArgument)
	}
	host, err := os.OpenFile(fmt.Sprintf("/proc/%d/root%s", pid, path), os.O_RDWR, 0)
	if err != nil {
		return st, fmt.Errorf("rehome: process %d: memory file %s: %w", pid, path, err)
	}
	defer host.Close()
	if err := extend(pid, vmas, host); err != nil {
		return st, err
	}
	if err := checkVMAs(pid, vmas); err != nil {
		return st, err
	}
	fd, err := p.open(path, unix.O_WRONLY|unix.O_CLOEXEC, vmas)
	if err != nil {
		var en unix.Errno
		if !errors.As(err, &en) && !errdefs.IsNotImplemented(err) {
			return st, err // the injection failed
		}
		// The process may not write the file: the tracer copies.
		n, cerr := CopyPages(pid, vmas, host)
		st.Bytes, st.ByTracer = n, n
		return st, cerr
	}
	pm, err := os.Open(fmt.Sprintf("/proc/%d/pagemap", pid))
	if err != nil {
		return st, errors.Join(fmt.Errorf("rehome: process %d: pagemap: %w", pid, err), p.close(fd))
	}
	defer pm.Close()
	c := copier{pid: pid, pm: pm, mem: p.mem, f: host, buf: make([]byte, copyChunk)}
	pmbuf := make([]byte, copyChunk/pageSize*8)
	var errs []error
	for _, v := range vmas {
		err := heldRuns(pid, pm, pmbuf, v, v.Start, v.End, func(addr, n uint64) error {
			return p.writeRun(fd, &c, v, addr, n, &st)
		})
		if err != nil {
			errs = append(errs, err)
			break
		}
	}
	errs = append(errs, p.close(fd))
	return st, errors.Join(errs...)
}

// smallRun is the run, in pages, below which the tracer copies instead of
// the process: an injected call costs tens of microseconds, more than
// copying a few pages twice, and a move after spread writes has hundreds of
// one-page runs. (The helper that moves a container writes only where it
// could not join the container's memory cgroup: those runs are charged to
// the helper's.)
const smallRun = 16

// writeRun has the process pwrite n held pages at addr of v into fd (at
// their place in v's slot); what it cannot write, the tracer copies with c
// (fd < 0: all of it; runs under smallRun pages).
func (p *proc) writeRun(fd int64, c *copier, v VMA, addr, n uint64, st *CopyStats) error {
	for n > 0 {
		k := min(n, maxWrite/pageSize)
		var w int64
		if fd >= 0 && k >= smallRun {
			off := v.Offset() + int64(addr-v.Start)
			r, err := p.syscall(unix.SYS_PWRITE64, uint64(fd), addr, k*pageSize, uint64(off))
			if err != nil {
				return err
			}
			st.Calls++
			w = max(r, 0) / pageSize * pageSize
			st.Bytes += w
		}
		if rest := k - uint64(w)/pageSize; rest > 0 {
			// EFAULT (PROT_NONE), a short write, or no descriptor.
			before := c.written
			if err := c.run(v, addr+uint64(w), rest); err != nil {
				return err
			}
			st.Bytes += c.written - before
			st.ByTracer += c.written - before
		}
		addr, n = addr+k*pageSize, n-k
	}
	return nil
}

// DefaultChunk is Move's default chunk size.
const DefaultChunk = 64 << 20

// Move is CopyPages and Remap together, chunk by chunk: for each VMA, up to
// chunk bytes (0: DefaultChunk) are written into the file by the process
// and mapped over at once before the next chunk, so the memory held twice
// (anonymous and in the file) during the move is at most one chunk, not the
// whole heap: a process near its memory limit can move. The chunks of a
// VMA map consecutive offsets of its slot with the same flags, so the
// kernel merges them back into one VMA. It returns the VMAs moved whole.
// A VMA that fails part-way stays split: the chunks done map the file
// (with the same bytes), the rest stays anonymous, and the error says so.
// With TracerCopies, or if the process may not open the file for writing,
// the tracer copies (CopyStats.ByTracer), still chunk by chunk, in windows
// spread over a few threads.
func (t *Tracee) Move(pid int, path string, vmas []VMA, chunk uint64) ([]VMA, CopyStats, error) {
	var done []VMA
	var st CopyStats
	err := t.do(func() error {
		var err error
		done, st, err = t.move(pid, path, vmas, chunk)
		return err
	})
	return done, st, err
}

// MoveFile is Move with the file opened by the caller for writing (host): for
// a process that sees the file only read-only (a container's memory view),
// where the caller copies and the process only maps.
func (t *Tracee) MoveFile(pid int, host *os.File, path string, vmas []VMA, chunk uint64) ([]VMA, CopyStats, error) {
	t.hostFile = host
	defer func() { t.hostFile = nil }()
	return t.Move(pid, path, vmas, chunk)
}

func (t *Tracee) move(pid int, path string, vmas []VMA, chunk uint64) ([]VMA, CopyStats, error) {
	var st CopyStats
	p, err := t.proc(pid)
	if err != nil || len(vmas) == 0 {
		return nil, st, err
	}
	if chunk == 0 {
		chunk = DefaultChunk
	}
	chunk = max(chunk/pageSize*pageSize, pageSize)
	if !strings.HasPrefix(path, "/") {
		return nil, st, fmt.Errorf("rehome: memory file path %q is not absolute: %w", path, errdefs.ErrInvalidArgument)
	}
	host := t.hostFile
	if host == nil {
		f, err := os.OpenFile(fmt.Sprintf("/proc/%d/root%s", pid, path), os.O_RDWR, 0)
		if err != nil {
			return nil, st, fmt.Errorf("rehome: process %d: memory file %s: %w", pid, path, err)
		}
		defer f.Close()
		host = f
	}
	if err := extend(pid, vmas, host); err != nil {
		return nil, st, err
	}
	if err := checkVMAs(pid, vmas); err != nil {
		return nil, st, err
	}
	fd, err := int64(-1), errdefs.ErrNotImplemented
	if !t.TracerCopies {
		fd, err = p.open(path, unix.O_RDWR|unix.O_CLOEXEC, vmas)
	}
	writeFD, passed := fd, int64(-1)
	if err != nil {
		var en unix.Errno
		if !errors.As(err, &en) && !errdefs.IsNotImplemented(err) {
			return nil, st, err
		}
		// The tracer copies (TracerCopies, or the process may not
		// write the file); the process only maps.
		if fd, err = p.open(path, unix.O_RDONLY|unix.O_CLOEXEC, vmas); err != nil {
			return nil, st, err
		}
		writeFD = -1
		if t.hostFile != nil && !t.TracerCopies {
			// It may still write through the caller's descriptor,
			// passed to it: one copy instead of the tracer's two. It
			// maps the file by its own path (fd), which is what CRIU
			// dumps.
			wfd, err := p.receiveFile(t.hostFile, vmas)
			switch {
			case err == nil:
				writeFD, passed = wfd, wfd
			case !errdefs.IsNotImplemented(err):
				return nil, st, errors.Join(err, p.close(fd))
			}
		}
	}
	pm, err := os.Open(fmt.Sprintf("/proc/%d/pagemap", pid))
	if err != nil {
		return nil, st, errors.Join(fmt.Errorf("rehome: process %d: pagemap: %w", pid, err), p.close(fd))
	}
	defer pm.Close()
	// The process writes (c copies its runs under smallRun pages), or the
	// tracer copies it all (workers).
	var c copier
	var pmbuf []byte
	var workers copiers
	var window uint64
	if writeFD >= 0 {
		c = copier{pid: pid, pm: pm, mem: p.mem, f: host, buf: make([]byte, copyChunk)}
		pmbuf = make([]byte, copyChunk/pageSize*8)
	} else {
		window = moveWindowFor(chunk)
		workers = copiersWith(pid, pm, p.mem, host, t.copyBuffers(window))
	}
	var done []VMA
	var errs []error
	// The mmaps wait in maps and go in batches (one ptrace round trip for
	// hundreds of patches), each after the writes of its range; a batch
	// goes as soon as it maps a chunk's worth, so that the memory held
	// twice stays about one chunk.
	failed := make([]bool, len(vmas))  // a chunk not moved: the VMA stays split
	reached := make([]bool, len(vmas)) // every chunk written and its map queued
	maps := mapBatch{p: p, fd: fd, path: path, chunk: chunk, failed: failed, st: &st, errs: &errs}
vmaLoop:
	for vi, v := range vmas {
		if v.Prepared && !v.scanned {
			// Scanned whole before its first chunk: a guard page
			// in a later chunk fails the region before any of it
			// is mapped, not once it is split.
			w, err := preparedWritten(pid, pm, v, v.Start, v.End)
			if err != nil {
				errs = append(errs, err)
				failed[vi] = true
				continue
			}
			v.written, v.scanned = w, true
		}
		for a := v.Start; a < v.End; a += chunk {
			b := min(a+chunk, v.End)
			if maps.bytes > 0 && maps.bytes+(b-a) > chunk {
				// Written and not yet mapped: at most one chunk.
				if !maps.flush() {
					break vmaLoop
				}
			}
			var err error
			if writeFD < 0 {
				// The tracer copies all of it: in parallel.
				var n int64
				n, err = workers.copy(windows(v, a, b, window))
				st.Bytes += n
				st.ByTracer += n
			} else {
				err = heldRuns(pid, pm, pmbuf, v, a, b, func(addr, n uint64) error {
					return p.writeRun(writeFD, &c, v, addr, n, &st)
				})
			}
			if err != nil {
				errs = append(errs, fmt.Errorf("rehome: process %d: %v moved up to %#x: %w", pid, v, a, err))
				failed[vi] = true
				if p.dead {
					break vmaLoop
				}
				continue vmaLoop
			}
			if maps.add(vi, v, a, b) && !maps.flush() {
				break vmaLoop
			}
			if failed[vi] {
				continue vmaLoop
			}
		}
		reached[vi] = true
	}
	maps.flush()
	for vi, v := range vmas {
		if reached[vi] && !failed[vi] {
			done = append(done, v)
		}
	}
	if err := p.dropBatch(); err != nil {
		errs = append(errs, err)
	}
	if passed >= 0 && !p.dead {
		errs = append(errs, p.close(passed))
	}
	errs = append(errs, p.close(fd))
	return done, st, errors.Join(errs...)
}

func cmpErr(e error, r int64) error {
	if e != nil {
		return e
	}
	return fmt.Errorf("mapped at %#x instead", uint64(r))
}

// checkVMAs verifies that each VMA is still exactly a mapping of the process
// with the planned protection.
func checkVMAs(pid int, vmas []VMA) error {
	b, err := readProc(pid, "maps", 0)
	if err != nil {
		return err
	}
	cur := parseMappings(b)
	for _, v := range vmas {
		if v.Prepared {
			if err := checkPieces(pid, cur, v); err != nil {
				return err
			}
			continue
		}
		// A patch is a part of a mapping; any other VMA a whole one.
		found := slices.ContainsFunc(cur, func(c mapping) bool {
			return c.Prot == v.Prot && c.Start <= v.Start && v.End <= c.End && (v.Whole || c.Start == v.Start && c.End == v.End)
		})
		if !found {
			return fmt.Errorf("rehome: process %d: VMA %v changed since it was planned (was the process running?): %w", pid, v, errdefs.ErrFailedPrecondition)
		}
	}
	return nil
}

// InstallFilter loads the classic BPF seccomp filter prog into process pid
// on all its threads (SECCOMP_FILTER_FLAG_TSYNC), by injection. The program
// is copied into a scratch mapping made and removed by injection. The
// kernel requires CAP_SYS_ADMIN or no_new_privs of the calling thread; a
// process without the capability is given no_new_privs
// (PR_SET_NO_NEW_PRIVS; TSYNC passes it to the other threads) and is listed
// in t.NoNewPrivs.
func (t *Tracee) InstallFilter(pid int, prog []unix.SockFilter) error {
	return t.do(func() error { return t.installFilter(pid, prog) })
}

func (t *Tracee) installFilter(pid int, prog []unix.SockFilter) (err error) {
	p, err := t.proc(pid)
	if err != nil {
		return err
	}
	if len(prog) == 0 || len(prog) > 4096 {
		return fmt.Errorf("rehome: seccomp program of %d instructions: %w", len(prog), errdefs.ErrInvalidArgument)
	}
	// struct sock_fprog { u16 len; (pad); struct sock_filter *filter; }
	// then the instructions.
	buf := make([]byte, 16+8*len(prog))
	size := uint64(len(buf)+pageSize-1) / pageSize * pageSize
	addr, err := p.syscall(unix.SYS_MMAP, 0, size, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS, ^uint64(0), 0)
	if err != nil {
		return err
	}
	if e := errno(addr); e != nil {
		return fmt.Errorf("rehome: process %d: scratch mapping for the filter: %w", pid, e)
	}
	defer func() {
		r, e := p.syscall(unix.SYS_MUNMAP, uint64(addr), size)
		if e == nil {
			e = errno(r)
		}
		if e != nil {
			err = errors.Join(err, fmt.Errorf("rehome: process %d: remove scratch mapping %#x: %w", pid, addr, e))
		}
	}()
	binary.LittleEndian.PutUint16(buf[0:], uint16(len(prog)))
	binary.LittleEndian.PutUint64(buf[8:], uint64(addr)+16)
	for i, in := range prog {
		o := 16 + 8*i
		binary.LittleEndian.PutUint16(buf[o:], in.Code)
		buf[o+2], buf[o+3] = in.Jt, in.Jf
		binary.LittleEndian.PutUint32(buf[o+4:], in.K)
	}
	if _, err := p.mem.WriteAt(buf, addr); err != nil {
		return fmt.Errorf("rehome: process %d: write the filter: %w", pid, err)
	}
	install := func() (int64, error) {
		return p.syscall(unix.SYS_SECCOMP, unix.SECCOMP_SET_MODE_FILTER, unix.SECCOMP_FILTER_FLAG_TSYNC, uint64(addr))
	}
	r, err := install()
	if err != nil {
		return err
	}
	if errno(r) == unix.EACCES {
		pr, err := p.syscall(unix.SYS_PRCTL, unix.PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)
		if err != nil {
			return err
		}
		if e := errno(pr); e != nil {
			return fmt.Errorf("rehome: process %d: prctl(PR_SET_NO_NEW_PRIVS): %w", pid, e)
		}
		t.NoNewPrivs = append(t.NoNewPrivs, pid)
		if r, err = install(); err != nil {
			return err
		}
	}
	if e := errno(r); e != nil {
		return fmt.Errorf("rehome: process %d: seccomp(SET_MODE_FILTER, TSYNC): %w", pid, e)
	}
	if r > 0 {
		return fmt.Errorf("rehome: process %d: seccomp TSYNC: thread %d has filters of its own: %w", pid, r, errdefs.ErrFailedPrecondition)
	}
	return nil
}

const ptraceSeccompGetFilter = 0x420c

// Filters returns the classic BPF seccomp filters of each thread of process
// pid (each thread's chain, oldest first, as the kernel stores them: 8-byte
// instructions), by PTRACE_SECCOMP_GET_FILTER. A thread not in filter mode
// has an empty chain.
func (t *Tracee) Filters(pid int) (chains [][][]byte, err error) {
	err = t.do(func() error {
		p, err := t.proc(pid)
		if err != nil {
			return err
		}
		// A filter has at most BPF_MAXINSNS instructions: one call each.
		buf := make([]byte, 8*unix.BPF_MAXINSNS)
		for _, tid := range p.tids {
			var chain [][]byte
			for i := 0; ; i++ {
				n, _, e := unix.Syscall6(unix.SYS_PTRACE, ptraceSeccompGetFilter, uintptr(tid), uintptr(i), uintptr(unsafe.Pointer(&buf[0])), 0, 0)
				if e == unix.ENOENT || e == unix.EINVAL && i == 0 {
					break // past the newest filter, or not in filter mode
				}
				if e != 0 || n == 0 || n > unix.BPF_MAXINSNS {
					return fmt.Errorf("rehome: process %d thread %d: PTRACE_SECCOMP_GET_FILTER %d: %d instructions, %w", pid, tid, i, n, e)
				}
				chain = append(chain, bytes.Clone(buf[:8*n]))
			}
			chains = append(chains, chain)
		}
		return nil
	})
	return chains, err
}

// Userfaultfd creates a userfaultfd in process pid (injected
// userfaultfd(2), user-mode faults only, so no capability is needed), takes
// it into the caller (pidfd_getfd) and closes the process's own: the
// process holds nothing, and the caller's ioctls act on the process's
// memory (StartPreCopy).
func (t *Tracee) Userfaultfd(pid int) (*os.File, error) {
	var f *os.File
	err := t.do(func() error {
		p, err := t.proc(pid)
		if err != nil {
			return err
		}
		r, err := p.syscall(unix.SYS_USERFAULTFD, unix.O_CLOEXEC|unix.O_NONBLOCK|uffdUserModeOnly)
		if err != nil {
			return err
		}
		if e := errno(r); e != nil {
			return fmt.Errorf("rehome: process %d: userfaultfd: %w", pid, e)
		}
		pidfd, err := unix.PidfdOpen(pid, 0)
		if err == nil {
			var fd int
			fd, err = unix.PidfdGetfd(pidfd, int(r), 0)
			unix.Close(pidfd)
			if err == nil {
				f = os.NewFile(uintptr(fd), fmt.Sprintf("userfaultfd of %d", pid))
			}
		}
		if err != nil {
			err = fmt.Errorf("rehome: process %d: take its userfaultfd: %w", pid, err)
		}
		return errors.Join(err, p.close(r))
	})
	if err != nil && f != nil {
		f.Close()
		f = nil
	}
	return f, err
}
