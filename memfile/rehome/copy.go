package rehome

import (
	"bytes"
	"cmp"
	"encoding/binary"
	"errors"
	"fmt"
	"os"
	"runtime"
	"slices"
	"sync"
	"sync/atomic"
	"unsafe"

	"github.com/containerd/errdefs"
	"golang.org/x/sys/unix"
)

// pagemap entry bits (Documentation/admin-guide/mm/pagemap.rst).
const (
	pmPresent  = 1 << 63
	pmSwapped  = 1 << 62
	pmFilePage = 1 << 61 // file page or shared anonymous: not a private copy
	pmGuard    = 1 << 58 // a guard region installed with MADV_GUARD_INSTALL
	pmPFN      = 1<<55 - 1
)

// copyChunk bounds the bytes read from the target at once.
const copyChunk = 4 << 20

// CopyPages copies the pages each VMA holds (present or swapped, per
// /proc/pid/pagemap) into f at the VMA's slot offset plus the page's offset
// in the VMA, and extends f to cover every slot. Pages never touched stay
// holes, and so do pages that hold only zeros: a hole reads zeros through a
// private mapping too. It returns the bytes written. The process must be
// stopped (Seize, SIGSTOP or a frozen cgroup) and stay stopped until Remap:
// a page written in between would be lost.
func CopyPages(pid int, vmas []VMA, f *os.File) (int64, error) {
	pm, err := os.Open(fmt.Sprintf("/proc/%d/pagemap", pid))
	if err != nil {
		return 0, fmt.Errorf("rehome: process %d: pagemap: %w", pid, errors.Join(err, errdefs.ErrNotFound))
	}
	defer pm.Close()
	mem, err := os.Open(fmt.Sprintf("/proc/%d/mem", pid))
	if err != nil {
		return 0, fmt.Errorf("rehome: process %d: mem: %w", pid, errors.Join(err, errdefs.ErrNotFound))
	}
	defer mem.Close()

	if err := extend(pid, vmas, f); err != nil {
		return 0, err
	}

	var jobs []window
	for _, v := range vmas {
		jobs = append(jobs, windows(v, v.Start, v.End, copyChunk)...)
	}
	return newCopiers(pid, pm, mem, f, copyChunk).copy(jobs)
}

// window is a part of a VMA the tracer copies at once.
type window struct {
	v          VMA
	start, end uint64
}

// moveWindow bounds the window of Move's own copy (TracerCopies): each
// worker's buffer is charged to the memory cgroup the tracer copies from,
// the process's, on top of the chunk it holds twice (see moveWindowFor).
const moveWindow = 256 << 10

// windows splits [start, end) of v into windows of size bytes.
func windows(v VMA, start, end, size uint64) []window {
	var ws []window
	for a := start; a < end; a += size {
		ws = append(ws, window{v, a, min(a+size, end)})
	}
	return ws
}

// copiers are the workers of a parallel copy from one process into one
// file; their buffers (of window bytes) are made once and reused: a move
// after spread writes copies hundreds of windows of a page or two.
type copiers []*copier

func newCopiers(pid int, pm, mem, f *os.File, window uint64) copiers {
	return copiersWith(pid, pm, mem, f, copyBuffers(window))
}

// copyBuffers makes a buffer of window bytes for each worker.
func copyBuffers(window uint64) [][]byte {
	bufs := make([][]byte, copyWorkers())
	for i := range bufs {
		bufs[i] = make([]byte, window)
	}
	return bufs
}

// copiersWith makes one copier per buffer (all of one size: the window).
func copiersWith(pid int, pm, mem, f *os.File, bufs [][]byte) copiers {
	cs := make(copiers, len(bufs))
	for i, b := range bufs {
		cs[i] = &copier{pid: pid, pm: pm, mem: mem, f: f, buf: b, pmbuf: make([]byte, len(b)/pageSize*8)}
	}
	return cs
}

func copyWorkers() int { return min(runtime.GOMAXPROCS(0), 4) }

// moveWindowFor is the window of a move in chunks of chunk bytes: the
// workers' buffers together at most a quarter of a chunk (the shim sizes
// chunks to half the headroom under the container's memory limit, and the
// buffers are charged there too), and at most moveWindow each.
func moveWindowFor(chunk uint64) uint64 {
	w := chunk / 4 / uint64(copyWorkers()) / pageSize * pageSize
	return max(min(w, moveWindow), pageSize)
}

// copy copies the held pages of each window into the file, the windows
// spread over the workers (the copy is bound by the per-page cost of
// reading the target and of allocating and filling tmpfs pages, which
// spreads over cores). It returns the bytes written.
func (cs copiers) copy(jobs []window) (int64, error) {
	unreadable := slices.ContainsFunc(jobs, func(j window) bool { return j.v.Prot&unix.PROT_READ == 0 })
	if len(jobs) == 1 || unreadable {
		// A patch of a page or two is not worth a wake-up of another
		// thread. Memory the process may not read is read through
		// /proc/pid/mem, which a kernel with proc_mem.force_override=ptrace
		// allows the tracer's own thread only: the caller's.
		c := cs[0]
		before := c.written
		for _, j := range jobs {
			if err := c.window(j.v, j.start, j.end); err != nil {
				return c.written - before, err
			}
		}
		return c.written - before, nil
	}
	workers := min(len(cs), len(jobs))
	var (
		next    atomic.Int64
		written atomic.Int64
		mu      sync.Mutex
		first   error
		wg      sync.WaitGroup
	)
	for _, c := range cs[:workers] {
		wg.Add(1)
		go func() {
			defer wg.Done()
			before := c.written
			defer func() { written.Add(c.written - before) }()
			for {
				i := int(next.Add(1) - 1)
				if i >= len(jobs) {
					return
				}
				mu.Lock()
				failed := first != nil
				mu.Unlock()
				if failed {
					return
				}
				j := jobs[i]
				if err := c.window(j.v, j.start, j.end); err != nil {
					mu.Lock()
					if first == nil {
						first = err
					}
					mu.Unlock()
					return
				}
			}
		}()
	}
	wg.Wait()
	return written.Load(), first
}

// extend checks the VMAs and makes f cover all their slots.
func extend(pid int, vmas []VMA, f *os.File) error {
	var size int64
	for _, v := range vmas {
		if v.Start%pageSize != 0 || v.End%pageSize != 0 || v.End <= v.Start || v.Slot < 0 || int64(v.Len()) > SlotSize {
			return fmt.Errorf("rehome: process %d: VMA %v (slot %d) is not a valid conversion: %w", pid, v, v.Slot, errdefs.ErrInvalidArgument)
		}
		size = max(size, v.Offset()+SlotSize)
	}
	if st, err := f.Stat(); err != nil {
		return fmt.Errorf("rehome: memory file %s: %w", f.Name(), err)
	} else if st.Size() < size {
		if err := f.Truncate(size); err != nil {
			return fmt.Errorf("rehome: memory file %s: extend to %d bytes: %w", f.Name(), size, err)
		}
	}
	return nil
}

// zeroPFN returns the page frame of the kernel's shared zero page (what a
// page only ever read maps), or 0 if pagemap hides frame numbers or the
// kernel maps no shared page on a read fault (then no present page is
// skipped).
var zeroPFN = sync.OnceValue(func() uint64 {
	// Two read faults at once: the shared zero page is the same frame in
	// both. A kernel that serves a read fault with a fresh page (seen on a
	// Firecracker guest's 6.18) gives two frames, and the one we saw is
	// freed with its mapping and reused, maybe for the very process being
	// moved: taking it for the zero page would skip that page of data.
	var pfns [2]uint64
	for i := range pfns {
		m, err := unix.Mmap(-1, 0, pageSize, unix.PROT_READ, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS)
		if err != nil {
			return 0
		}
		defer unix.Munmap(m)
		if pfns[i] = readFaultPFN(m); pfns[i] == 0 {
			return 0
		}
	}
	if pfns[0] != pfns[1] {
		return 0 // no shared zero page: every present page holds data
	}
	return pfns[0]
})

// readFaultPFN reads m's first byte (a read fault) and returns the frame
// the kernel mapped there, or 0.
func readFaultPFN(m []byte) uint64 {
	if readByte(&m[0]) != 0 {
		return 0
	}
	pm, err := os.Open("/proc/self/pagemap")
	if err != nil {
		return 0
	}
	defer pm.Close()
	var b [8]byte
	addr := uint64(uintptr(unsafe.Pointer(&m[0])))
	if _, err := pm.ReadAt(b[:], int64(addr/pageSize*8)); err != nil {
		return 0
	}
	e := binary.LittleEndian.Uint64(b[:])
	if e&pmPresent == 0 {
		return 0
	}
	return e & pmPFN
}

// readByte reads *p where the compiler cannot drop the read.
//
//go:noinline
func readByte(p *byte) byte { return *p }

// heldRuns calls fn, in address order, for each run of pages of v in
// [start, end) that hold data: present (other than the zero page) or
// swapped; every page of a Whole VMA; of a Prepared one, the pages its
// process wrote since the preparation (the zero page included).
func heldRuns(pid int, pm *os.File, pmbuf []byte, v VMA, start, end uint64, fn func(addr, n uint64) error) error {
	if v.Whole {
		// .data: the clean pages are the file's bytes, not holes.
		return fn(start, (end-start)/pageSize)
	}
	if v.Prepared || v.PreCopied {
		// The slot holds the files' bytes (or the precopy's): only the
		// process's own copies (anonymous pages inside the file
		// mappings; written since the precopy) go on top.
		written := v.written
		if !v.scanned {
			var err error
			if written, err = preparedWritten(pid, pm, v, start, end); err != nil {
				return err
			}
		}
		i, _ := slices.BinarySearchFunc(written, start, func(w [2]uint64, a uint64) int { return cmp.Compare(w[1], a+1) })
		for _, w := range written[i:] {
			s, e := max(w[0], start), min(w[1], end)
			if s >= e {
				break
			}
			if err := fn(s, (e-s)/pageSize); err != nil {
				return err
			}
		}
		return nil
	}
	zero := zeroPFN()
	held := func(e uint64) bool {
		return e&pmSwapped != 0 || (e&pmPresent != 0 && (zero == 0 || e&pmPFN != zero))
	}
	for addr := start; addr < end; {
		n := min((end-addr)/pageSize, uint64(len(pmbuf)/8))
		pmb := pmbuf[:n*8]
		if _, err := pm.ReadAt(pmb, int64(addr/pageSize*8)); err != nil {
			return fmt.Errorf("rehome: process %d: pagemap of %v: %w", pid, v, err)
		}
		for i := uint64(0); i < n; {
			e := binary.LittleEndian.Uint64(pmb[i*8:])
			if e&pmGuard != 0 {
				return guardErr(pid, v)
			}
			if !held(e) {
				i++
				continue
			}
			j := i + 1
			for j < n {
				e := binary.LittleEndian.Uint64(pmb[j*8:])
				if !held(e) || e&pmGuard != 0 {
					break
				}
				j++
			}
			if err := fn(addr+i*pageSize, j-i); err != nil {
				return err
			}
			i = j
		}
		addr += n * pageSize
	}
	return nil
}

// preparedWritten returns the runs of pages in [start, end) of v, a Prepared
// VMA, that its process wrote since the preparation (a few pages in a
// region of up to the whole heap, which the kernel finds faster than a read
// of its pagemap), or an error for a guard page among them: mapping the
// region anew would drop it.
func preparedWritten(pid int, pm *os.File, v VMA, start, end uint64) ([][2]uint64, error) {
	written, guard, err := scanWritten(pm, start, end)
	if errors.Is(err, errNoScan) {
		written, guard, err = readWritten(pm, start, end)
	}
	switch {
	case err != nil:
		return nil, fmt.Errorf("rehome: process %d: %v: %w", pid, v, err)
	case guard:
		return nil, guardErr(pid, v)
	}
	return written, nil
}

func guardErr(pid int, v VMA) error {
	return fmt.Errorf("rehome: process %d: VMA %v has guard pages (MADV_GUARD_INSTALL), which a file mapping would lose: %w",
		pid, v, errdefs.ErrNotImplemented)
}

type copier struct {
	pid     int
	pm, mem *os.File
	f       *os.File
	buf     []byte
	pmbuf   []byte
	written int64
	// held, if not nil, records by slot the runs of held pages copied.
	held map[int][][2]uint64
}

var zeroPage [pageSize]byte

// window copies the held pages of v in [start, end).
func (c *copier) window(v VMA, start, end uint64) error {
	return heldRuns(c.pid, c.pm, c.pmbuf, v, start, end, func(addr, n uint64) error {
		if c.held != nil {
			c.held[v.Slot] = append(c.held[v.Slot], [2]uint64{addr, addr + n*pageSize})
		}
		return c.run(v, addr, n)
	})
}

// run copies n held pages at addr, skipping zero pages.
func (c *copier) run(v VMA, addr, n uint64) error {
	for n > uint64(len(c.buf)/pageSize) {
		k := uint64(len(c.buf) / pageSize)
		if err := c.run(v, addr, k); err != nil {
			return err
		}
		addr, n = addr+k*pageSize, n-k
	}
	b := c.buf[:n*pageSize]
	// process_vm_readv pins pages in batches; it stops at memory the
	// process cannot read (PROT_NONE), which /proc/pid/mem reads.
	got, _ := unix.ProcessVMReadv(c.pid, []unix.Iovec{{Base: &b[0], Len: uint64(len(b))}},
		[]unix.RemoteIovec{{Base: uintptr(addr), Len: len(b)}}, 0)
	got = max(got, 0) / pageSize * pageSize
	if got < len(b) {
		if _, err := c.mem.ReadAt(b[got:], int64(addr)+int64(got)); err != nil {
			return fmt.Errorf("rehome: process %d: read %d pages at %#x of %v: %w", c.pid, n, addr, v, err)
		}
	}
	base := v.Offset() + int64(addr-v.Start)
	if v.Prepared || v.PreCopied {
		// Zeros too: the slot holds the file's bytes there, not a hole.
		w, err := c.f.WriteAt(b, base)
		c.written += int64(w)
		if err != nil {
			return fmt.Errorf("rehome: memory file %s: write %v: %w", c.f.Name(), v, err)
		}
		return nil
	}
	for i := uint64(0); i < n; {
		if bytes.Equal(b[i*pageSize:(i+1)*pageSize], zeroPage[:]) {
			i++
			continue
		}
		j := i + 1
		for j < n && !bytes.Equal(b[j*pageSize:(j+1)*pageSize], zeroPage[:]) {
			j++
		}
		w, err := c.f.WriteAt(b[i*pageSize:j*pageSize], base+int64(i*pageSize))
		c.written += int64(w)
		if err != nil {
			return fmt.Errorf("rehome: memory file %s: write %v: %w", c.f.Name(), v, err)
		}
		i = j
	}
	return nil
}
