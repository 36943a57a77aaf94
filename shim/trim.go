package shim

import (
	"math"
	"os"
	"runtime/debug"
	"sync"
	"time"

	"github.com/containerd/log"
)

// trimDelay is how long the shim waits after its last checkpoint or restore
// before handing its free heap back to the kernel.
const trimDelay = 2 * time.Second

// heapTrimmer keeps an idle shim's memory at what it needs. A checkpoint or a
// batch of restores grows the heap for a moment (image parsing, runc and
// CRIU output); Go's background scavenger returns that slowly, and a shim
// then idles for hours holding it, once per shim group. So once a burst is
// over (trimDelay after its last RPC) the trimmer collects and returns the
// free heap to the kernel, which costs a millisecond or two, and sets a soft
// memory limit a little above what the shim holds then (idleLimit): the small
// RPCs of an idle shim (kill, state, wait, events) no longer let garbage grow
// to GOGC's goal, set by the burst's peak, before a collection, and what a
// collection frees goes back to the kernel. The next burst lifts the limit
// for its duration (begin), so restores and checkpoints never collect more
// often than without it; and should what the shim needs grow while it is
// idle (containerd reconnecting to every task, an exec), the limit follows
// it after each collection (regrow), so that the collector never runs back to
// back against it. A GOMEMLIMIT from the environment is left alone.
type heapTrimmer struct {
	mu      sync.Mutex
	timer   *time.Timer
	busy    int   // bursts under way (begin without its end)
	limited bool  // the idle limit is set
	limit   int64 // the idle limit when limited
	watch   sync.Once
}

// begin marks the start of an RPC of a burst (a create, a start, a
// checkpoint, a delete): the idle limit is lifted until its end, which
// schedules the next trim.
func (t *heapTrimmer) begin() (end func()) {
	t.mu.Lock()
	t.busy++
	if t.limited {
		debug.SetMemoryLimit(math.MaxInt64)
		t.limited = false
	}
	t.mu.Unlock()
	return func() {
		t.mu.Lock()
		t.busy--
		t.mu.Unlock()
		t.soon()
	}
}

// soon schedules a trim trimDelay from now, postponing one already pending.
func (t *heapTrimmer) soon() {
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.timer == nil {
		t.timer = time.AfterFunc(trimDelay, t.trim)
		return
	}
	t.timer.Reset(trimDelay)
}

// trim collects and returns the free heap to the kernel and, unless a burst
// began meanwhile, sets the idle limit; it logs (at debug level) what the Go
// runtime holds afterwards.
func (t *heapTrimmer) trim() {
	debug.FreeOSMemory()
	m := readGoMem()
	t.mu.Lock()
	if t.busy == 0 && os.Getenv("GOMEMLIMIT") == "" {
		t.limit = idleLimit(m)
		debug.SetMemoryLimit(t.limit)
		t.limited = true
		t.watch.Do(func() { afterEachGC(t.regrow) })
	}
	t.mu.Unlock()
	log.L.Debugf("lazyfork: heap trimmed: %s", m)
}

// regrow raises the idle limit, after a collection, when what the shim
// needs leaves less than half the headroom below it.
func (t *heapTrimmer) regrow() {
	t.mu.Lock()
	defer t.mu.Unlock()
	if !t.limited {
		return
	}
	need := readGoMem().needed()
	if l := withHeadroom(need); need+(l-need)/2 > t.limit {
		t.limit = l
		debug.SetMemoryLimit(l)
	}
}
