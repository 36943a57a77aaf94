package madvguard

import (
	"bufio"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"
)

// Supervisor serves a Zero-mode guard: it traces every thread of a restored
// process tree and turns each purging madvise the guard stops into an
// anonymous mmap(MAP_FIXED) of the same range, with the range's protection,
// then makes the call return 0. The range reads as zeros and its memory is
// freed, as MADV_DONTNEED on anonymous memory would. A call it cannot
// convert (the range spans mappings of different protection, or a shared or
// unmapped part) fails with EINVAL, as in Refuse mode.
//
// A traced process cannot be dumped: Detach before a dump (the guard then
// answers ENOSYS, which allocators treat like EINVAL) and Attach after.
//
// All ptrace calls run on one locked OS thread, which blocks in wait4 for its
// own tracees only (__WNOTHREAD) and is woken by the kernel directly;
// commands ring a doorbell (a sleeping child of that thread) to wake it.
// Run it in a process that is not the tracees' real parent (a helper
// process; see Serve): a parent's own wait for the tracee could take a
// ptrace stop meant for the supervisor.
//
// If the supervisor dies while a call is stopped, that one call runs as a
// plain madvise (the kernel lets a SECCOMP_RET_TRACE call through once its
// tracer is gone); later calls fail with ENOSYS.
//
// Converted ranges lose what madvise set on them before (MADV_DONTDUMP,
// huge page hints) and their prctl name.
type Supervisor struct {
	root int
	mu   sync.Mutex // serialises commands
	cmds chan command
	bell atomic.Int64 // pid of the tracer's doorbell child
	done chan struct{}
	err  error

	zeroed, refused, stops, moved atomic.Uint64
	busy                          atomic.Int64 // ns spent handling stops
}

// Stats counts what a Supervisor did.
type Stats struct {
	Zeroed  uint64        // calls turned into fresh anonymous mappings
	Refused uint64        // calls failed with EINVAL
	Stops   uint64        // ptrace stops handled (all kinds)
	Moved   uint64        // parts of mremap calls' old ranges made anonymous
	Busy    time.Duration // time spent handling seccomp stops
}

type command struct {
	op    string // "detach", "attach", "close"
	reply chan error
}

const traceOpts = unix.PTRACE_O_TRACESECCOMP | unix.PTRACE_O_TRACECLONE | unix.PTRACE_O_TRACEFORK |
	unix.PTRACE_O_TRACEVFORK | unix.PTRACE_O_TRACESYSGOOD

// Supervise attaches to every thread of the process tree rooted at root.
func Supervise(root int) (*Supervisor, error) {
	s := &Supervisor{root: root, cmds: make(chan command, 1), done: make(chan struct{})}
	started := make(chan error, 1)
	go s.loop(started)
	if err := <-started; err != nil {
		return nil, err
	}
	return s, nil
}

func (s *Supervisor) do(op string) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	select {
	case <-s.done:
		return fmt.Errorf("madvguard supervisor stopped: %v", s.err)
	default:
	}
	c := command{op: op, reply: make(chan error, 1)}
	s.cmds <- c
	// Ring: the doorbell is only reaped (and its pid freed) by the tracer
	// after it dies, and only commands kill it, one at a time (s.mu).
	if pid := int(s.bell.Load()); pid > 0 {
		unix.Kill(pid, unix.SIGKILL)
	}
	select {
	case err := <-c.reply:
		return err
	case <-s.done:
		return fmt.Errorf("madvguard supervisor stopped: %v", s.err)
	}
}

// Detach lets go of every tracee (before a dump of the tree).
func (s *Supervisor) Detach() error { return s.do("detach") }

// Hold stops every thread of the tree in a ptrace stop and keeps it there
// (a call being converted finishes first). Then freeze the tree's cgroup
// (threads in a ptrace stop count as frozen) and Release: each thread goes
// from its stop straight into the freezer, so none runs a guarded call
// untraced (which would fail with ENOSYS) between the detach and the freeze.
// Unhold lets the threads run on, traced, when the freeze failed.
func (s *Supervisor) Hold() error { return s.do("hold") }

// Release detaches from the threads Hold stopped.
func (s *Supervisor) Release() error { return s.do("release") }

// Unhold resumes the threads Hold stopped, still traced.
func (s *Supervisor) Unhold() error { return s.do("unhold") }

// Attach traces the tree again (after a dump).
func (s *Supervisor) Attach() error { return s.do("attach") }

// Close detaches and stops the supervisor.
func (s *Supervisor) Close() error {
	err := s.do("close")
	<-s.done
	return err
}

// Done is closed when the supervisor stops (Close, or a fatal error).
func (s *Supervisor) Done() <-chan struct{} { return s.done }

// Stats returns the counts so far.
func (s *Supervisor) Stats() Stats {
	return Stats{Zeroed: s.zeroed.Load(), Refused: s.refused.Load(), Stops: s.stops.Load(), Moved: s.moved.Load(), Busy: time.Duration(s.busy.Load())}
}

type tracee struct {
	tgid  int
	held  bool // in a ptrace stop Hold asked for; resumed by Unhold or detached by Release
	group bool // that stop is a group stop (SIGSTOP and the like): Unhold listens

	inExit bool   // stopped the converted call; its exit stop comes next
	addr   uint64 // start of the converted range
	move   *moveConversion
}

// moveConversion is an mremap whose old range is being made anonymous: the
// call was turned into an anonymous mmap of one part; at its exit the
// part's bytes go back and the mremap runs again.
type moveConversion struct {
	regs  unix.PtraceRegs // the mremap as stopped
	start uint64
	data  []byte
}

type tracer struct {
	s         *Supervisor
	tracees   map[int]*tracee
	detaching bool
	holding   bool             // interrupt stops are kept (Hold) instead of resumed
	maps      map[int]*os.File // /proc/<tgid>/maps, for PROCMAP_QUERY
	tid       int              // the tracer thread (tracees' TracerPid)
	bell      atomic.Int64     // pid of the doorbell child
	bellProc  *os.Process
}

func ptrace(req, pid int, addr, data uintptr) error {
	_, _, e := unix.Syscall6(unix.SYS_PTRACE, uintptr(req), uintptr(pid), addr, data, 0, 0)
	if e != 0 {
		return e
	}
	return nil
}

func (s *Supervisor) loop(started chan<- error) {
	runtime.LockOSThread() // ptrace requests must come from the tracer thread; never unlocked
	defer close(s.done)
	t := &tracer{s: s, tracees: map[int]*tracee{}, maps: map[int]*os.File{}, tid: unix.Gettid()}
	defer t.closeMaps()
	defer t.stopBell()
	if err := t.startBell(); err != nil {
		s.err = err
		started <- err
		return
	}
	if err := t.attachTree(); err != nil {
		t.detachAll()
		s.err = err
		started <- err
		return
	}
	started <- nil
	for {
		tid, ws, err := t.wait(true)
		if err != nil {
			s.err = fmt.Errorf("madvguard: wait: %w", err)
			t.detachAll()
			return
		}
		if int64(tid) != t.bell.Load() {
			t.handle(tid, ws)
			continue
		}
		// The doorbell rang: a command is queued (or someone killed it).
		// A new doorbell goes up before the queue is read, so a command
		// queued meanwhile is either seen here or rings the new one.
		t.bellRang()
		if err := t.startBell(); err != nil {
			s.err = err
			t.detachAll()
			return
		}
		for more := true; more; {
			select {
			case c := <-s.cmds:
				if t.command(c) {
					return
				}
			default:
				more = false
			}
		}
	}
}

// command runs one command and replies; it reports whether to stop.
func (t *tracer) command(c command) bool {
	var err error
	switch c.op {
	case "detach":
		err = t.detachAll()
	case "attach":
		err = t.attachTree()
	case "hold":
		err = t.holdAll()
	case "release":
		err = t.releaseHeld()
	case "unhold":
		t.unholdAll()
	case "close":
		err = t.detachAll()
		t.stopBell()
		t.s.err = errors.New("closed")
		c.reply <- err
		return true
	}
	c.reply <- err
	return false
}

// The tracer thread blocks in wait4 for its tracees, woken by the kernel
// directly (a SIGCHLD through the Go runtime costs extra wake-ups on every
// stop). Commands reach it through a doorbell: a sleeping child of the
// tracer thread that do() kills, which ends the wait.

func (t *tracer) startBell() error {
	// Pdeathsig: the doorbell dies with the tracer thread, never outlives it.
	p, err := os.StartProcess(sleepPath(), []string{"sleep", "2147483647"},
		&os.ProcAttr{Sys: &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}})
	if err != nil {
		return fmt.Errorf("madvguard: doorbell: %w", err)
	}
	t.bellProc = p
	t.bell.Store(int64(p.Pid))
	t.s.bell.Store(int64(p.Pid))
	return nil
}

// bellRang forgets a doorbell that has been reaped.
func (t *tracer) bellRang() {
	if t.bellProc != nil {
		t.bellProc.Release()
		t.bellProc = nil
	}
	t.bell.Store(0)
	t.s.bell.Store(0)
}

func (t *tracer) stopBell() {
	if pid := int(t.bell.Load()); pid > 0 {
		unix.Kill(pid, unix.SIGKILL)
		var ws unix.WaitStatus
		unix.Wait4(pid, &ws, unix.WALL, nil)
		t.bellRang()
	}
}

func sleepPath() string {
	for _, p := range []string{"/bin/sleep", "/usr/bin/sleep"} {
		if _, err := os.Stat(p); err == nil {
			return p
		}
	}
	if p, err := exec.LookPath("sleep"); err == nil {
		return p
	}
	return "sleep"
}

// wait returns the next stop or exit of a tracee or the doorbell.
func (t *tracer) wait(block bool) (int, unix.WaitStatus, error) {
	for {
		var ws unix.WaitStatus
		flags := unix.WALL | unix.WNOTHREAD
		if !block {
			flags |= unix.WNOHANG
		}
		tid, err := unix.Wait4(-1, &ws, flags, nil)
		if err == unix.EINTR {
			continue
		}
		return tid, ws, err
	}
}

// drain handles the stops that are pending and reports how many. A doorbell
// that rings meanwhile is replaced (its command, if any, stays queued for the
// main loop, which the next doorbell wakes).
func (t *tracer) drain() int {
	n := 0
	for {
		tid, ws, err := t.wait(false)
		if err != nil || tid <= 0 {
			return n
		}
		n++
		if int64(tid) == t.bell.Load() {
			t.bellRang()
			t.startBell()
			continue
		}
		t.handle(tid, ws)
	}
}

// forgetUntraced drops the tracees this thread no longer traces: gone, or
// never seen alive (a thread that exited before its parent's clone event
// named it, whose tid may now be anyone's). Waiting for their stop would
// never end.
func (t *tracer) forgetUntraced() {
	for tid := range t.tracees {
		b, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", tid))
		if err != nil || !strings.Contains(string(b), fmt.Sprintf("\nTracerPid:\t%d\n", t.tid)) {
			delete(t.tracees, tid)
		}
	}
}

func (t *tracer) resume(tid int, tr *tracee, sig int) {
	if t.detaching {
		ptrace(unix.PTRACE_DETACH, tid, 0, uintptr(sig))
		delete(t.tracees, tid)
		return
	}
	ptrace(unix.PTRACE_CONT, tid, 0, uintptr(sig))
}

func (t *tracer) handle(tid int, ws unix.WaitStatus) {
	t.s.stops.Add(1)
	tr := t.tracees[tid]
	if ws.Exited() || ws.Signaled() {
		delete(t.tracees, tid)
		return
	}
	if !ws.Stopped() {
		return
	}
	if tr == nil { // an auto-attached child whose fork event we have not seen yet
		tr = &tracee{tgid: tgidOf(tid)}
		t.tracees[tid] = tr
	}
	sig := ws.StopSignal()
	event := (int(ws) >> 16) & 0xff
	switch {
	case sig == unix.SIGTRAP|0x80: // syscall exit of a converted call
		t.onExit(tid, tr)
	case sig == unix.SIGTRAP && event == unix.PTRACE_EVENT_SECCOMP:
		t.onSeccomp(tid, tr)
	case sig == unix.SIGTRAP && (event == unix.PTRACE_EVENT_CLONE || event == unix.PTRACE_EVENT_FORK || event == unix.PTRACE_EVENT_VFORK):
		if msg, err := unix.PtraceGetEventMsg(tid); err == nil {
			if _, ok := t.tracees[int(msg)]; !ok {
				t.tracees[int(msg)] = &tracee{tgid: tgidOf(int(msg))}
			}
		}
		t.resume(tid, tr, 0)
	case event == unix.PTRACE_EVENT_STOP && t.holding && !t.detaching:
		tr.held = true
		tr.group = sig == unix.SIGSTOP || sig == unix.SIGTSTP || sig == unix.SIGTTIN || sig == unix.SIGTTOU
	case event == unix.PTRACE_EVENT_STOP:
		if (sig == unix.SIGSTOP || sig == unix.SIGTSTP || sig == unix.SIGTTIN || sig == unix.SIGTTOU) && !t.detaching {
			ptrace(unix.PTRACE_LISTEN, tid, 0, 0) // group stop: stay stopped
			return
		}
		t.resume(tid, tr, 0)
	case sig == unix.SIGTRAP && event != 0:
		t.resume(tid, tr, 0)
	default: // signal delivery: pass it on
		t.resume(tid, tr, int(sig))
	}
}

func (t *tracer) onSeccomp(tid int, tr *tracee) {
	start := time.Now()
	defer func() { t.s.busy.Add(int64(time.Since(start))) }()
	var regs unix.PtraceRegs
	if err := unix.PtraceGetRegs(tid, &regs); err != nil {
		t.resume(tid, tr, 0)
		return
	}
	if regs.Orig_rax == unix.SYS_MREMAP {
		t.onMremap(tid, tr, &regs)
		return
	}
	if regs.Orig_rax != unix.SYS_MADVISE {
		t.resume(tid, tr, 0)
		return
	}
	addr := regs.Rdi
	length := (regs.Rsi + 4095) &^ 4095
	prot, ok := t.protOf(tr.tgid, addr, addr+length)
	if !ok || addr&4095 != 0 || length == 0 {
		regs.Orig_rax = ^uint64(0) // skip the call; rax is its result
		regs.Rax = negErrno(unix.EINVAL)
		unix.PtraceSetRegs(tid, &regs)
		t.s.refused.Add(1)
		t.resume(tid, tr, 0)
		return
	}
	regs.Orig_rax = unix.SYS_MMAP
	regs.Rdi, regs.Rsi, regs.Rdx = addr, length, uint64(prot)
	regs.R10 = unix.MAP_PRIVATE | unix.MAP_ANONYMOUS | unix.MAP_FIXED
	regs.R8, regs.R9 = ^uint64(0), 0
	if err := unix.PtraceSetRegs(tid, &regs); err != nil {
		t.resume(tid, tr, 0)
		return
	}
	tr.inExit, tr.addr = true, addr
	ptrace(unix.PTRACE_SYSCALL, tid, 0, 0) // stop again at the exit to fix the result
}

// onMremap serves a stopped mremap that grows or moves guarded memory: the
// memory-file mappings in its old range become anonymous memory holding
// the same bytes, one part (at most moveChunk bytes of one VMA) per stop,
// then the call runs as the program made it, on anonymous memory: a growth
// reads zeros, a moved range takes no file along. The call is restarted
// after each part, and stops again while a part is left.
func (t *tracer) onMremap(tid int, tr *tracee, regs *unix.PtraceRegs) {
	// The kernel rounds the old length up to whole pages: so does the part.
	part, prot, ok := memoryFilePart(tr.tgid, regs.Rdi, (regs.Rdi+regs.Rsi+4095)&^4095)
	if !ok {
		t.resume(tid, tr, 0) // nothing of a memory file (left): the call runs
		return
	}
	data := make([]byte, part.End-part.Start)
	if err := procMem(tid, data, part.Start, false); err != nil {
		regs.Orig_rax = ^uint64(0)
		regs.Rax = negErrno(unix.ENOMEM)
		unix.PtraceSetRegs(tid, regs)
		t.s.refused.Add(1)
		t.resume(tid, tr, 0)
		return
	}
	mv := &moveConversion{regs: *regs, start: part.Start, data: data}
	regs.Orig_rax = unix.SYS_MMAP
	regs.Rdi, regs.Rsi, regs.Rdx = part.Start, part.End-part.Start, uint64(prot)
	regs.R10 = unix.MAP_PRIVATE | unix.MAP_ANONYMOUS | unix.MAP_FIXED
	regs.R8, regs.R9 = ^uint64(0), 0
	if err := unix.PtraceSetRegs(tid, regs); err != nil {
		t.resume(tid, tr, 0)
		return
	}
	tr.inExit, tr.move = true, mv
	ptrace(unix.PTRACE_SYSCALL, tid, 0, 0)
}

// moveExit finishes one part of an mremap's conversion: the part's bytes
// go into the new anonymous mapping (zero pages skipped: they read as
// zeros already), and the mremap is made to run again.
func (t *tracer) moveExit(tid int, tr *tracee, mv *moveConversion) {
	var regs unix.PtraceRegs
	if err := unix.PtraceGetRegs(tid, &regs); err != nil {
		t.resume(tid, tr, 0)
		return
	}
	again := mv.regs
	switch {
	case regs.Rax != mv.start: // the mmap failed: the old mapping is there still
		again.Rax = regs.Rax
		t.s.refused.Add(1)
	case writeNonZero(tid, mv.data, mv.start) != nil:
		again.Rax = negErrno(unix.EFAULT) // cannot happen: the mapping is ours and fresh
		t.s.refused.Add(1)
	default:
		// Back to the syscall instruction (2 bytes), with its number in rax.
		again.Rip -= 2
		again.Rax = again.Orig_rax
		t.s.moved.Add(1)
	}
	unix.PtraceSetRegs(tid, &again)
	t.resume(tid, tr, 0)
}

func (t *tracer) onExit(tid int, tr *tracee) {
	if !tr.inExit {
		t.resume(tid, tr, 0)
		return
	}
	tr.inExit = false
	if mv := tr.move; mv != nil {
		tr.move = nil
		t.moveExit(tid, tr, mv)
		return
	}
	var regs unix.PtraceRegs
	if err := unix.PtraceGetRegs(tid, &regs); err == nil {
		if regs.Rax == tr.addr {
			regs.Rax = 0
			t.s.zeroed.Add(1)
		} else {
			regs.Rax = negErrno(unix.EINVAL)
			t.s.refused.Add(1)
		}
		unix.PtraceSetRegs(tid, &regs)
	}
	t.resume(tid, tr, 0)
}

// attachTree seizes every thread of every process under root, until a pass
// finds nothing new.
func (t *tracer) attachTree() error {
	t.detaching = false
	for pass := 0; pass < 50; pass++ {
		tids, err := treeThreads(t.s.root)
		if err != nil {
			return err
		}
		added := 0
		for tid, tgid := range tids {
			if _, ok := t.tracees[tid]; ok {
				continue
			}
			if err := ptrace(unix.PTRACE_SEIZE, tid, 0, traceOpts); err != nil {
				if errors.Is(err, unix.ESRCH) {
					continue
				}
				if errors.Is(err, unix.EPERM) { // already traced (by us, via auto-attach)
					continue
				}
				return fmt.Errorf("madvguard: PTRACE_SEIZE %d: %w", tid, err)
			}
			t.tracees[tid] = &tracee{tgid: tgid}
			added++
		}
		if added == 0 {
			return nil
		}
	}
	return fmt.Errorf("madvguard: tree of %d keeps growing while attaching", t.s.root)
}

// detachAll stops every tracee and detaches at that stop, finishing any
// converted call first.
func (t *tracer) detachAll() error {
	t.detaching = true
	for tid := range t.tracees {
		if err := ptrace(unix.PTRACE_INTERRUPT, tid, 0, 0); errors.Is(err, unix.ESRCH) {
			delete(t.tracees, tid)
		}
	}
	t.closeMaps() // a later attach may find other processes under the same pids
	// A converted call still sees its exit stop first (resume detaches at it).
	deadline := time.Now().Add(10 * time.Second)
	for len(t.tracees) > 0 {
		if time.Now().After(deadline) {
			return fmt.Errorf("madvguard: %d tracees did not stop for detach", len(t.tracees))
		}
		if t.drain() == 0 {
			t.forgetUntraced()
			time.Sleep(200 * time.Microsecond)
		}
	}
	return nil
}

// holdAll interrupts every tracee and waits until each sits in its
// interrupt stop (see Supervisor.Hold). Threads born meanwhile are
// auto-attached and stop the same way.
func (t *tracer) holdAll() error {
	t.holding = true
	for tid, tr := range t.tracees {
		if tr.held {
			continue
		}
		if err := ptrace(unix.PTRACE_INTERRUPT, tid, 0, 0); errors.Is(err, unix.ESRCH) {
			delete(t.tracees, tid)
		}
	}
	deadline := time.Now().Add(10 * time.Second)
	for {
		waiting := 0
		for _, tr := range t.tracees {
			if !tr.held {
				waiting++
			}
		}
		if waiting == 0 {
			return nil
		}
		if time.Now().After(deadline) {
			t.unholdAll()
			return fmt.Errorf("madvguard: %d tracees did not stop to be held", waiting)
		}
		if t.drain() == 0 {
			t.forgetUntraced()
			// A thread auto-attached at a clone we saw may not have been
			// interrupted yet.
			for tid, tr := range t.tracees {
				if !tr.held {
					ptrace(unix.PTRACE_INTERRUPT, tid, 0, 0)
				}
			}
			time.Sleep(200 * time.Microsecond)
		}
	}
}

// releaseHeld detaches from every held tracee; it stays where Hold put it
// (or, its cgroup frozen meanwhile, in the freezer).
func (t *tracer) releaseHeld() error {
	t.holding = false
	var errs []error
	for tid, tr := range t.tracees {
		if !tr.held {
			errs = append(errs, fmt.Errorf("madvguard: thread %d is not held", tid))
			continue
		}
		if err := ptrace(unix.PTRACE_DETACH, tid, 0, 0); err != nil && !errors.Is(err, unix.ESRCH) {
			errs = append(errs, fmt.Errorf("madvguard: detach %d: %w", tid, err))
		}
		delete(t.tracees, tid)
	}
	t.closeMaps()
	if len(errs) > 0 {
		// Whatever is left is still traced: let it run.
		t.unholdAll()
	}
	return errors.Join(errs...)
}

// unholdAll resumes the held tracees, still traced.
func (t *tracer) unholdAll() {
	t.holding = false
	for tid, tr := range t.tracees {
		if !tr.held {
			continue
		}
		tr.held = false
		if tr.group {
			ptrace(unix.PTRACE_LISTEN, tid, 0, 0)
		} else {
			ptrace(unix.PTRACE_CONT, tid, 0, 0)
		}
	}
}

// treeThreads maps every thread of root's process tree to its tgid.
func treeThreads(root int) (map[int]int, error) {
	out := map[int]int{}
	queue := []int{root}
	for len(queue) > 0 {
		pid := queue[0]
		queue = queue[1:]
		ents, err := os.ReadDir(fmt.Sprintf("/proc/%d/task", pid))
		if err != nil {
			if pid == root {
				return nil, fmt.Errorf("madvguard: process %d: %w", root, err)
			}
			continue
		}
		for _, e := range ents {
			tid, err := strconv.Atoi(e.Name())
			if err != nil {
				continue
			}
			out[tid] = pid
			b, _ := os.ReadFile(fmt.Sprintf("/proc/%d/task/%d/children", pid, tid))
			for _, f := range strings.Fields(string(b)) {
				if c, err := strconv.Atoi(f); err == nil {
					queue = append(queue, c)
				}
			}
		}
	}
	return out, nil
}

func tgidOf(tid int) int {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", tid))
	if err != nil {
		return tid
	}
	for _, l := range strings.Split(string(b), "\n") {
		if v, ok := strings.CutPrefix(l, "Tgid:"); ok {
			if n, err := strconv.Atoi(strings.TrimSpace(v)); err == nil {
				return n
			}
		}
	}
	return tid
}

func (t *tracer) closeMaps() {
	for k, f := range t.maps {
		f.Close()
		delete(t.maps, k)
	}
}

// procmapQuery is struct procmap_query (linux/fs.h, Linux 6.11+).
type procmapQuery struct {
	Size, QueryFlags, QueryAddr, VmaStart, VmaEnd, VmaFlags, VmaPageSize, VmaOffset, Inode uint64
	DevMajor, DevMinor, VmaNameSize, BuildIDSize                                           uint32
	VmaNameAddr, BuildIDAddr                                                               uint64
}

const (
	ioctlProcmapQuery = 0xC0686611 // _IOWR('f', 17, struct procmap_query)
	pmqReadable       = 0x01
	pmqWritable       = 0x02
	pmqExecutable     = 0x04
	pmqShared         = 0x08
)

// protOf returns the protection of [start, end) when private mappings of
// one protection cover all of it. It asks the kernel per VMA with
// PROCMAP_QUERY (no text to generate and parse: the call is on the
// tracee's critical path), and falls back to parsing the maps file.
func (t *tracer) protOf(tgid int, start, end uint64) (int, bool) {
	f := t.maps[tgid]
	if f == nil {
		var err error
		if f, err = os.Open(fmt.Sprintf("/proc/%d/maps", tgid)); err != nil {
			return 0, false
		}
		t.maps[tgid] = f
	}
	next, prot := start, -1
	for next < end {
		q := procmapQuery{Size: uint64(unsafe.Sizeof(procmapQuery{})), QueryAddr: next}
		_, _, e := unix.Syscall(unix.SYS_IOCTL, f.Fd(), ioctlProcmapQuery, uintptr(unsafe.Pointer(&q)))
		if e == unix.ENOTTY || e == unix.EINVAL {
			return protFromMaps(tgid, start, end) // kernel before 6.11
		}
		if e != 0 || q.VmaStart > next || q.VmaEnd <= next || q.VmaFlags&pmqShared != 0 {
			return 0, false
		}
		p := 0
		if q.VmaFlags&pmqReadable != 0 {
			p |= unix.PROT_READ
		}
		if q.VmaFlags&pmqWritable != 0 {
			p |= unix.PROT_WRITE
		}
		if q.VmaFlags&pmqExecutable != 0 {
			p |= unix.PROT_EXEC
		}
		if prot >= 0 && p != prot {
			return 0, false
		}
		prot, next = p, q.VmaEnd
	}
	return prot, prot >= 0
}

// protFromMaps is protOf by parsing /proc/<tgid>/maps.
func protFromMaps(tgid int, start, end uint64) (int, bool) {
	f, err := os.Open(fmt.Sprintf("/proc/%d/maps", tgid))
	if err != nil {
		return 0, false
	}
	defer f.Close()
	next, prot := start, -1
	sc := bufio.NewScanner(f)
	for sc.Scan() && next < end {
		line := sc.Text()
		dash := strings.IndexByte(line, '-')
		sp := strings.IndexByte(line, ' ')
		if dash < 0 || sp < dash || len(line) < sp+5 {
			return 0, false
		}
		lo, err1 := strconv.ParseUint(line[:dash], 16, 64)
		hi, err2 := strconv.ParseUint(line[dash+1:sp], 16, 64)
		if err1 != nil || err2 != nil || hi <= next {
			continue
		}
		if lo > next {
			return 0, false // a hole
		}
		perms := line[sp+1 : sp+5]
		if perms[3] != 'p' {
			return 0, false
		}
		p := 0
		if perms[0] == 'r' {
			p |= unix.PROT_READ
		}
		if perms[1] == 'w' {
			p |= unix.PROT_WRITE
		}
		if perms[2] == 'x' {
			p |= unix.PROT_EXEC
		}
		if prot >= 0 && p != prot {
			return 0, false
		}
		prot, next = p, hi
	}
	return prot, prot >= 0 && next >= end
}

// negErrno is a syscall's failing return value as rax holds it.
func negErrno(e unix.Errno) uint64 { return uint64(-int64(e)) }

// memFileExt ends the name of a memory file (memfile.FileExt; this package
// does not import memfile).
const memFileExt = ".mem"

// moveChunk bounds the bytes one stop of an mremap conversion copies.
const moveChunk = 64 << 20

// memoryFilePart finds the first part of [start, end) that a private
// mapping of a memory file covers, at most moveChunk bytes of one VMA,
// and its protection.
func memoryFilePart(tgid int, start, end uint64) (Range, int, bool) {
	f, err := os.Open(fmt.Sprintf("/proc/%d/maps", tgid))
	if err != nil {
		return Range{}, 0, false
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		fs := strings.Fields(sc.Text())
		if len(fs) < 6 {
			continue // anonymous
		}
		lo, hi, ok := strings.Cut(fs[0], "-")
		if !ok {
			continue
		}
		s, err1 := strconv.ParseUint(lo, 16, 64)
		e, err2 := strconv.ParseUint(hi, 16, 64)
		if err1 != nil || err2 != nil || e <= start {
			continue
		}
		if s >= end {
			break
		}
		path := strings.TrimSuffix(strings.Join(fs[5:], " "), " (deleted)")
		perms := fs[1]
		if len(perms) < 4 || perms[3] != 'p' || !strings.HasSuffix(path, memFileExt) {
			continue
		}
		prot := 0
		if perms[0] == 'r' {
			prot |= unix.PROT_READ
		}
		if perms[1] == 'w' {
			prot |= unix.PROT_WRITE
		}
		if perms[2] == 'x' {
			prot |= unix.PROT_EXEC
		}
		r := Range{max(s, start), min(e, end)}
		r.End = min(r.End, r.Start+moveChunk)
		return r, prot, true
	}
	return Range{}, 0, false
}

// procMem reads (or writes) a tracee's memory at addr through
// /proc/<tid>/mem, which reaches pages whatever their protection.
func procMem(tid int, b []byte, addr uint64, write bool) error {
	flag := os.O_RDONLY
	if write {
		flag = os.O_RDWR
	}
	f, err := os.OpenFile(fmt.Sprintf("/proc/%d/mem", tid), flag, 0)
	if err != nil {
		return err
	}
	defer f.Close()
	var n int
	if write {
		n, err = f.WriteAt(b, int64(addr))
	} else {
		n, err = f.ReadAt(b, int64(addr))
	}
	if err == nil && n != len(b) {
		err = fmt.Errorf("/proc/%d/mem at %#x: %d of %d bytes", tid, addr, n, len(b))
	}
	return err
}

// writeNonZero writes b at addr into the tracee, page by page, skipping
// pages of zeros (fresh anonymous memory reads zeros already, and an
// untouched page costs nothing).
func writeNonZero(tid int, b []byte, addr uint64) error {
	const page = 4096
	for off := 0; off < len(b); {
		for off < len(b) && allZero(b[off:min(off+page, len(b))]) {
			off += page
		}
		end := off
		for end < len(b) && !allZero(b[end:min(end+page, len(b))]) {
			end += page
		}
		end = min(end, len(b))
		if end > off {
			if err := procMem(tid, b[off:end], addr+uint64(off), true); err != nil {
				return err
			}
		}
		off = end
	}
	return nil
}

func allZero(b []byte) bool {
	for _, c := range b {
		if c != 0 {
			return false
		}
	}
	return true
}
