package shim

import (
	"runtime/debug"
	"sync"
	"time"
)

// trimDelay is how long the shim waits after its last checkpoint or restore
// before handing its free heap back to the kernel.
const trimDelay = 2 * time.Second

// heapTrimmer returns a shim's free heap to the kernel once a burst of work
// is over. A checkpoint or a batch of restores grows the heap for a moment
// (image parsing, runc and CRIU output); Go's background scavenger returns
// that slowly, and a shim then idles for hours holding it, once per shim
// group. A forced collection after the burst costs a millisecond or two.
type heapTrimmer struct {
	mu    sync.Mutex
	timer *time.Timer
}

// soon schedules a trim trimDelay from now, postponing one already pending.
func (t *heapTrimmer) soon() {
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.timer == nil {
		t.timer = time.AfterFunc(trimDelay, debug.FreeOSMemory)
		return
	}
	t.timer.Reset(trimDelay)
}
