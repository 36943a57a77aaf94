//go:build linux && amd64

package rehome

import (
	"encoding/binary"
	"fmt"
	"os"
	"strconv"
	"strings"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"
)

// A move's patches are hundreds of mmaps (one per island of pages a
// process wrote), and an injected call costs a ptrace round trip: registers
// set, two syscall stops, registers read and put back, 25-75 us each on a
// busy 2-CPU guest, 7-22 ms for a move of 290 patches. A batch runs them
// all in one round trip: the process maps a small stub (r-x, anonymous)
// that loops over a table of calls, and the tracer lets it run to the trap
// at its end. The stub mapping is unmapped at the end of each move.

// batchCode runs the calls of the table at rbx (batchEntry bytes each: the
// number, six arguments, the result expected), r12 of them, until one
// returns anything else, then traps (int3). At the trap rbx points at the
// entry it stopped at, r12 counts the entries not done (that one included)
// and rax holds the last result.
var batchCode = [...]byte{
	0x4d, 0x85, 0xe4, // loop: test r12, r12
	0x74, 0x2c, // jz trap
	0x48, 0x8b, 0x03, // mov rax, [rbx]
	0x48, 0x8b, 0x7b, 0x08, // mov rdi, [rbx+8]
	0x48, 0x8b, 0x73, 0x10, // mov rsi, [rbx+16]
	0x48, 0x8b, 0x53, 0x18, // mov rdx, [rbx+24]
	0x4c, 0x8b, 0x53, 0x20, // mov r10, [rbx+32]
	0x4c, 0x8b, 0x43, 0x28, // mov r8, [rbx+40]
	0x4c, 0x8b, 0x4b, 0x30, // mov r9, [rbx+48]
	0x0f, 0x05, // syscall
	0x48, 0x3b, 0x43, 0x38, // cmp rax, [rbx+56]
	0x75, 0x09, // jne trap
	0x48, 0x83, 0xc3, 0x40, // add rbx, 64
	0x49, 0xff, 0xcc, // dec r12
	0xeb, 0xcf, // jmp loop
	0xcc, // trap: int3
	// A tracer killed at the trap leaves the thread past it, with a
	// handler for the SIGTRAP it gets then: it spins here rather than run
	// on into the table.
	0xeb, 0xfe, // jmp .
}

// batchTrapEnd is the offset in batchCode right after the int3: the rip
// of the thread at the trap's stop.
const batchTrapEnd = 50

// BatchEnv set to "off" turns batches off: every map is injected on its own.
const BatchEnv = "LAZYFORK_REHOME_BATCH"

const (
	batchEntry = 64
	batchMax   = 1024 // calls per run: the table fills 16 pages after the stub's
	batchSize  = pageSize + batchMax*batchEntry
)

// batchCall is one system call of a batch and the result that lets the
// batch go on.
type batchCall struct {
	nr   uint64
	args [6]uint64
	want uint64
}

// batchUsable reports whether process pid may run a batch: the stub ends
// in int3, whose SIGTRAP the kernel forces through, and a process that
// ignores SIGTRAP would get its disposition reset to the default by it. (A
// SIGTRAP pending or sent meanwhile is taken at the stub, and sent again
// after: runBatch.)
func batchUsable(pid int) bool {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		return false
	}
	for l := range strings.SplitSeq(string(b), "\n") {
		if v, ok := strings.CutPrefix(l, "SigIgn:"); ok {
			m, err := strconv.ParseUint(strings.TrimSpace(v), 16, 64)
			return err == nil && m&(uint64(1)<<(unix.SIGTRAP-1)) == 0
		}
	}
	return false
}

// setupBatch maps the stub into p's process, once. It reports whether
// batches can run; err is an injection failure (the process is gone or
// cannot be traced), not a refusal, which only turns batches off.
func (p *proc) setupBatch() (bool, error) {
	if p.batchAt != 0 || p.batchOff {
		return p.batchAt != 0, nil
	}
	if os.Getenv(BatchEnv) == "off" || !batchUsable(p.pid) {
		p.batchOff = true
		return false, nil
	}
	r, err := p.syscall(unix.SYS_MMAP, 0, batchSize, unix.PROT_READ|unix.PROT_EXEC, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS, ^uint64(0), 0)
	if err != nil {
		return false, err
	}
	if errno(r) != nil {
		p.batchOff = true // an exec-memory policy (SELinux execmem): one call at a time
		return false, nil
	}
	p.batchAt = uint64(r)
	// /proc/pid/mem writes through the mapping's protection (FOLL_FORCE),
	// as a debugger's breakpoint does.
	if _, err := p.mem.WriteAt(batchCode[:], int64(p.batchAt)); err != nil {
		p.batchOff = true
		return false, p.dropBatch()
	}
	return true, nil
}

// dropBatch unmaps the stub, if mapped.
func (p *proc) dropBatch() error {
	if p.batchAt == 0 || p.dead {
		return nil
	}
	at := p.batchAt
	p.batchAt = 0
	r, err := p.syscall(unix.SYS_MUNMAP, at, batchSize)
	if err != nil {
		return err
	}
	if e := errno(r); e != nil {
		return fmt.Errorf("rehome: process %d: unmap the batch stub at %#x: %w", p.pid, at, e)
	}
	return nil
}

// runBatch runs calls (at most batchMax) in p's injection thread through
// the stub. It returns how many returned their expected result, in order,
// and the result of the one after them that did not (if n < len(calls)).
// An error means the injection failed.
func (p *proc) runBatch(calls []batchCall) (n int, last int64, err error) {
	if p.dead {
		return 0, 0, fmt.Errorf("rehome: process %d is gone", p.pid)
	}
	defer func() {
		if err != nil && !p.dead {
			// The thread's own registers and mask back, wherever the
			// batch stopped: the maps it made hold the same bytes.
			p.restore()
		}
	}()
	table := make([]byte, len(calls)*batchEntry)
	for i, c := range calls {
		e := table[i*batchEntry:]
		binary.LittleEndian.PutUint64(e, c.nr)
		for j, a := range c.args {
			binary.LittleEndian.PutUint64(e[8+8*j:], a)
		}
		binary.LittleEndian.PutUint64(e[56:], c.want)
	}
	if _, err := p.mem.WriteAt(table, int64(p.batchAt+pageSize)); err != nil {
		return 0, 0, fmt.Errorf("rehome: process %d: write the batch table: %w", p.pid, err)
	}
	regs := p.saved
	regs.Rip = p.batchAt
	regs.Rbx = p.batchAt + pageSize
	regs.R12 = uint64(len(calls))
	regs.Orig_rax = ^uint64(0) // no syscall restart on the way out of the stop
	// Every signal blocked but the stub's SIGTRAP: a blocked SIGTRAP
	// forced by int3 would reset the process's handler for it.
	mask := ^uint64(0) &^ (uint64(1) << (unix.SIGTRAP - 1))
	if err := ptraceRaw(ptraceSetSigmask, p.inj, 8, uintptr(unsafe.Pointer(&mask))); err != nil {
		return 0, 0, fmt.Errorf("rehome: process %d: thread %d: block signals: %w", p.pid, p.inj, err)
	}
	p.injected = true
	if err := unix.PtraceSetRegs(p.inj, &regs); err != nil {
		return 0, 0, fmt.Errorf("rehome: process %d: thread %d: set registers: %w", p.pid, p.inj, err)
	}
	end := p.batchAt + batchTrapEnd
	strayTrap := false
	for {
		if err := unix.PtraceCont(p.inj, 0); err != nil {
			return 0, 0, fmt.Errorf("rehome: process %d: thread %d: resume: %w", p.pid, p.inj, err)
		}
		ws, err := p.wait(p.inj)
		if err != nil {
			return 0, 0, fmt.Errorf("rehome: process %d: thread %d: wait: %w", p.pid, p.inj, err)
		}
		switch {
		case ws.Exited() || ws.Signaled():
			p.dead = true
			return 0, 0, fmt.Errorf("rehome: process %d: thread %d died in a batch (%v)", p.pid, p.inj, ws)
		case !ws.Stopped():
			continue
		case int(ws)>>eventShift == unix.PTRACE_EVENT_STOP:
			if isStopSig(ws.StopSignal()) {
				p.stopSig = int(ws.StopSignal())
			}
			continue
		}
		// Every signal stop drops its signal: the thread is resumed with
		// none.
		sig := ws.StopSignal()
		if isStopSig(sig) {
			// Sent meanwhile: the process stops again on Detach.
			p.stopSig = int(sig)
			continue
		}
		var out unix.PtraceRegs
		if err := unix.PtraceGetRegs(p.inj, &out); err != nil {
			return 0, 0, fmt.Errorf("rehome: process %d: thread %d: get registers: %w", p.pid, p.inj, err)
		}
		if sig == unix.SIGTRAP && out.Rip != end {
			// Sent to it meanwhile (kill -TRAP): sent again after.
			strayTrap = true
			continue
		}
		if sig != unix.SIGTRAP || out.R12 > uint64(len(calls)) {
			return 0, 0, fmt.Errorf("rehome: process %d: thread %d: signal %v at %#x in a batch", p.pid, p.inj, sig, out.Rip)
		}
		n = len(calls) - int(out.R12)
		if err := p.restore(); err != nil {
			return 0, 0, err
		}
		if strayTrap {
			unix.Tgkill(p.pid, p.inj, unix.SIGTRAP)
		}
		return n, int64(out.Rax), nil
	}
}

// mapBatch holds a move's mmaps of fd (path in process p) until a batch
// runs them, and keeps their outcome in the move's failed, st and errs.
type mapBatch struct {
	p      *proc
	fd     int64
	path   string
	chunk  uint64 // the move's chunk: run once the queue maps that many bytes
	failed []bool // by the move's VMA index
	st     *CopyStats
	errs   *[]error

	entries []mapEntry
	bytes   uint64
}

type mapEntry struct {
	vma  int // index in the move's VMAs
	v    VMA
	a, b uint64
}

// add queues the map of [a, b) of v (the move's VMA vi) and reports
// whether the queue should run now.
func (m *mapBatch) add(vi int, v VMA, a, b uint64) bool {
	m.entries = append(m.entries, mapEntry{vi, v, a, b})
	m.bytes += b - a
	return m.bytes >= m.chunk || len(m.entries) >= batchMax
}

// flush maps the queued ranges, in batches when the process can run them
// and one call each otherwise. A map that fails marks its VMA in failed
// (the VMA stays split: the chunks before it map the file, the rest is
// unchanged) and its later entries are skipped. It reports false if the
// injection failed: every entry not run is failed.
func (m *mapBatch) flush() bool {
	p, fd, path, failed, st, errs := m.p, m.fd, m.path, m.failed, m.st, m.errs
	t0 := time.Now()
	defer func() { st.Map += time.Since(t0) }()
	entries := m.entries
	m.entries, m.bytes = m.entries[:0], 0
	call := func(e mapEntry) batchCall {
		return batchCall{nr: unix.SYS_MMAP, want: e.a, args: [6]uint64{e.a, e.b - e.a, uint64(e.v.Prot),
			uint64(unix.MAP_PRIVATE | unix.MAP_FIXED | e.v.Flags), uint64(fd), uint64(e.v.Offset() + int64(e.a-e.v.Start))}}
	}
	fail := func(e mapEntry, r int64) {
		failed[e.vma] = true
		*errs = append(*errs, fmt.Errorf("rehome: process %d: map %s over %#x-%#x of %v at offset %#x: %v (moved up to %#x, the rest is unchanged)",
			p.pid, path, e.a, e.b, e.v, e.v.Offset()+int64(e.a-e.v.Start), cmpErr(errno(r), r), e.a))
	}
	abort := func(err error, rest []mapEntry) bool {
		*errs = append(*errs, err)
		for _, e := range rest {
			failed[e.vma] = true
		}
		return false
	}
	for len(entries) > 0 {
		if failed[entries[0].vma] {
			entries = entries[1:]
			continue
		}
		var run []batchCall
		var idx []int
		for i, e := range entries {
			if len(run) == batchMax {
				break
			}
			if !failed[e.vma] {
				run, idx = append(run, call(e)), append(idx, i)
			}
		}
		batched := false
		if len(run) > 1 {
			var err error
			if batched, err = p.setupBatch(); err != nil {
				return abort(err, entries)
			}
		}
		if !batched {
			e := entries[0]
			c := call(e)
			r, err := p.syscall(uintptr(c.nr), c.args[:]...)
			if err != nil {
				return abort(err, entries)
			}
			if uint64(r) != c.want {
				fail(e, r)
			}
			entries = entries[1:]
			continue
		}
		n, last, err := p.runBatch(run)
		if err != nil {
			return abort(err, entries)
		}
		st.Batched += n
		if n < len(run) {
			fail(entries[idx[n]], last)
			entries = entries[idx[n]+1:]
			continue
		}
		entries = entries[idx[len(idx)-1]+1:]
	}
	return true
}
