package shim

import (
	"math"
	"runtime"
	"runtime/debug"
	"testing"
)

// An idle shim's Go memory limit sits a little above what it holds after a
// trim; a burst lifts it until its end; a GOMEMLIMIT from the environment is
// never overridden.
func TestHeapTrimmerIdleLimit(t *testing.T) {
	t.Setenv("GOMEMLIMIT", "")
	orig := debug.SetMemoryLimit(-1)
	defer debug.SetMemoryLimit(orig)
	debug.SetMemoryLimit(math.MaxInt64)

	var tr heapTrimmer
	defer func() { // no trim pending, and its collection watch idle
		tr.mu.Lock()
		if tr.timer != nil {
			tr.timer.Stop()
		}
		tr.limited = false
		tr.mu.Unlock()
	}()
	tr.trim()
	m := readGoMem()
	held := int64(m.Total - m.HeapReleased)
	lim := debug.SetMemoryLimit(-1)
	if lim == math.MaxInt64 || lim < held || lim > held+max(held/4, 4<<20) {
		t.Fatalf("idle limit %d, want a little above the %d bytes held", lim, held)
	}

	end := tr.begin()
	if l := debug.SetMemoryLimit(-1); l != math.MaxInt64 {
		t.Fatalf("limit during a burst %d, want none", l)
	}
	end2 := tr.begin() // a second RPC of the burst
	end()
	tr.trim() // the trim of the first RPC's end, with the second under way
	if l := debug.SetMemoryLimit(-1); l != math.MaxInt64 {
		t.Fatalf("limit with an RPC of the burst under way %d, want none", l)
	}
	end2()
	tr.trim()
	if l := debug.SetMemoryLimit(-1); l == math.MaxInt64 {
		t.Fatal("no idle limit after the burst")
	}

	debug.SetMemoryLimit(math.MaxInt64)
	tr.mu.Lock()
	tr.limited = false
	tr.mu.Unlock()
	t.Setenv("GOMEMLIMIT", "1GiB")
	tr.trim()
	if l := debug.SetMemoryLimit(-1); l != math.MaxInt64 {
		t.Fatalf("limit %d set over GOMEMLIMIT", l)
	}
}

// What an idle shim needs may grow without a burst (containerd reconnecting
// to every task): after a collection the limit follows it, headroom and all,
// so the collector does not run back to back against it.
func TestHeapTrimmerRegrow(t *testing.T) {
	t.Setenv("GOMEMLIMIT", "")
	orig := debug.SetMemoryLimit(-1)
	defer debug.SetMemoryLimit(orig)
	debug.SetMemoryLimit(math.MaxInt64)

	var tr heapTrimmer
	defer func() { // its collection watch outlives the test: make it idle
		tr.mu.Lock()
		tr.limited = false
		tr.mu.Unlock()
	}()
	tr.trim()
	before := debug.SetMemoryLimit(-1)
	// Live data well past the headroom.
	grow := make([][]byte, 64)
	for i := range grow {
		grow[i] = make([]byte, 256<<10)
		for j := range grow[i] {
			grow[i][j] = byte(j)
		}
	}
	var lim int64
	for range 100 { // the finalizer runs after the collection, in its own goroutine
		runtime.GC()
		runtime.Gosched()
		tr.mu.Lock()
		lim = tr.limit
		tr.mu.Unlock()
		if lim > before {
			break
		}
	}
	need := readGoMem().needed()
	if lim < need || debug.SetMemoryLimit(-1) != lim {
		t.Fatalf("idle limit %d (set %d) after %d MB more live data, want at least the %d bytes needed",
			lim, debug.SetMemoryLimit(-1), len(grow)/4, need)
	}
	runtime.KeepAlive(grow)
}
