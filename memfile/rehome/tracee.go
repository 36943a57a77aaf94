package rehome

import (
	"errors"
	"fmt"
	"os"
	"runtime"
	"sort"
	"strconv"
	"sync"
	"time"

	"github.com/containerd/errdefs"
	"golang.org/x/sys/unix"
)

// Tracee holds processes seized with ptrace: every thread of each is in a
// ptrace stop until Detach. All ptrace calls go through one OS thread (the
// tracer), so a Tracee's methods may be called from any goroutine, one at a
// time.
type Tracee struct {
	cgroup string
	procs  map[int]*proc
	order  []int
	calls  chan func()
	done   chan struct{}
	once   sync.Once
	clean  bool // every tracee detached: the tracer thread may be reused

	pending map[int]unix.WaitStatus // wait statuses not yet asked for, by thread

	// hostFile is the caller's writable handle on the file during MoveFile.
	hostFile *os.File

	// TracerCopies has Move copy the pages itself (process_vm_readv and
	// pwrite, a few windows in parallel) instead of the processes' own
	// injected pwrite. Set it when the caller runs in the processes' memory
	// cgroup, where the file's pages are charged either way. Where a
	// hypervisor shadows guest page tables (the Firecracker guests CI runs
	// on), the kernel's first read of a process's freshly written memory
	// through its own addresses costs about 9 us a page: the injected
	// pwrite of a 256 MiB heap into tmpfs took 557 ms there, the same pages
	// through a buffer 87 ms (and by vmsplice and splice 74 ms).
	TracerCopies bool
	// copyBufs are the tracer's copy buffers, kept for the Tracee's later
	// moves: a buffer made again may come from freed heap the runtime
	// zeroes, every page of it charged to the caller's cgroup once more.
	copyBufs [][]byte

	// NoNewPrivs lists the processes InstallFilter had to give
	// no_new_privs (they lacked CAP_SYS_ADMIN).
	NoNewPrivs []int
}

// do runs fn on the tracer thread.
func (t *Tracee) do(fn func() error) error {
	select {
	case <-t.done:
		return fmt.Errorf("rehome: tracer already detached: %w", errdefs.ErrFailedPrecondition)
	default:
	}
	ch := make(chan error, 1)
	t.calls <- func() { ch <- fn() }
	return <-ch
}

func newTracee(cgroup string) *Tracee {
	t := &Tracee{cgroup: cgroup, procs: map[int]*proc{}, calls: make(chan func()), done: make(chan struct{})}
	go func() {
		runtime.LockOSThread()
		for fn := range t.calls {
			fn()
		}
		if t.clean {
			runtime.UnlockOSThread()
		}
		// Otherwise the thread exits with the goroutine and the kernel
		// detaches whatever it still traces.
		close(t.done)
	}()
	return t
}

func (t *Tracee) stop() {
	t.once.Do(func() { close(t.calls) })
	<-t.done
}

// Pids returns the seized processes.
func (t *Tracee) Pids() []int { return append([]int(nil), t.order...) }

// Seize stops every thread of the processes pids with PTRACE_SEIZE and
// PTRACE_INTERRUPT and waits until each is in a ptrace stop. frozenCgroup,
// if not "", is a cgroup (v1 freezer directory or v2 directory) that holds
// the processes FROZEN: they are seized frozen, the cgroup is thawed so the
// seized threads enter their ptrace stops (a seized task with an interrupt
// pending stops before it runs user code), and Detach freezes it again
// before letting go. Every process of a frozen cgroup must be in pids, or
// the others run while the cgroup is thawed. A process stopped by a signal
// (SIGSTOP) is stopped again on Detach.
//
// The processes must not be children waited for by another thread of the
// caller: a concurrent wait4 on them would take the ptrace stops.
func Seize(frozenCgroup string, pids ...int) (*Tracee, error) {
	if len(pids) == 0 {
		return nil, fmt.Errorf("rehome: no process to seize: %w", errdefs.ErrInvalidArgument)
	}
	if err := supported(); err != nil {
		return nil, err
	}
	t := newTracee(frozenCgroup)
	err := t.do(func() error { return t.seize(pids) })
	if err != nil {
		t.stop()
		return nil, err
	}
	return t, nil
}

// Detach puts back every seized thread's registers and signal mask, freezes
// the cgroup again if Seize thawed it, and detaches. Interrupted system
// calls restart as if nothing happened. It returns the first error; the
// tracees are detached in any case (the tracer thread exits if a detach
// failed, which detaches the rest).
func (t *Tracee) Detach() error {
	err := t.do(t.detach)
	t.stop()
	return err
}

func listTasks(pid int) ([]int, error) {
	ents, err := os.ReadDir(fmt.Sprintf("/proc/%d/task", pid))
	if err != nil {
		return nil, fmt.Errorf("rehome: process %d: %w", pid, errors.Join(err, errdefs.ErrNotFound))
	}
	var tids []int
	for _, e := range ents {
		if n, err := strconv.Atoi(e.Name()); err == nil {
			tids = append(tids, n)
		}
	}
	sort.Ints(tids)
	return tids, nil
}

// CopyStats describes a Tracee.CopyPages.
type CopyStats struct {
	Bytes    int64 // bytes written into the file
	Calls    int   // pwrite calls the process made
	ByTracer int64 // bytes the tracer copied instead (see CopyPages)
	// Map is the time Move spent in the mmap calls it injected (one per
	// VMA and chunk): a patch costs one, however small.
	Map time.Duration
	// Batched counts the mmaps that ran in batches (one ptrace round trip
	// for up to batchMax of them) rather than injected one by one.
	Batched int
}

// copyBuffers returns the tracer's copy buffers of window bytes, made once.
func (t *Tracee) copyBuffers(window uint64) [][]byte {
	if len(t.copyBufs) == 0 || uint64(len(t.copyBufs[0])) != window {
		t.copyBufs = copyBuffers(window)
	}
	return t.copyBufs
}
