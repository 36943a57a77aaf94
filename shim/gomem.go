package shim

import (
	"fmt"
	"runtime"
	"runtime/metrics"
)

// goMem is what the Go runtime holds of a shim's memory, from
// runtime/metrics: its heap's live objects, the heap's free pages still
// resident, the goroutine stacks, and the runtime's own structures. Only the
// part not released to the kernel counts in the shim's RSS.
type goMem struct {
	HeapObjects  uint64 // bytes of live and not yet swept heap objects
	HeapFree     uint64 // free heap pages not returned to the kernel
	HeapReleased uint64 // free heap pages returned to the kernel (not resident)
	HeapUnused   uint64 // spans in use but not holding objects (fragmentation)
	Stacks       uint64 // goroutine and OS thread stacks the runtime allocated
	Runtime      uint64 // the runtime's metadata: spans, GC, profiling, other
	Goroutines   uint64
	Total        uint64 // all the runtime mapped, released pages included
	HeapLive     uint64 // bytes of the objects the last collection found live
}

// idleHeadroom is how far above what it holds after a trim an idle shim's
// memory limit is: a fraction of it, at least idleHeadroomMin.
const (
	idleHeadroomDiv = 8
	idleHeadroomMin = 1 << 20
)

// idleLimit is the soft memory limit of an idle shim that holds m: the
// runtime's memory as the limit counts it (all it mapped less what it
// released) and the headroom.
func idleLimit(m goMem) int64 {
	return withHeadroom(int64(m.Total - m.HeapReleased))
}

func withHeadroom(held int64) int64 { return held + max(held/idleHeadroomDiv, idleHeadroomMin) }

// needed is what the runtime would hold after a collection and a full
// scavenge: all it mapped less its free and released pages, with the heap's
// objects counted as the last collection found them live.
func (m goMem) needed() int64 {
	return int64(m.Total-m.HeapReleased-m.HeapFree-m.HeapObjects) + int64(m.HeapLive)
}

// resident is the Go runtime's share of the shim's anonymous memory.
func (m goMem) resident() uint64 {
	return m.HeapObjects + m.HeapFree + m.HeapUnused + m.Stacks + m.Runtime
}

func (m goMem) String() string {
	mb := func(v uint64) float64 { return float64(v) / 1e6 }
	return fmt.Sprintf("Go runtime %.2f MB mapped, %.2f MB resident at most: heap objects %.2f MB, unused in spans %.2f MB, free %.2f MB (released %.2f MB), stacks %.2f MB, runtime %.2f MB; %d goroutines",
		mb(m.Total), mb(m.resident()), mb(m.HeapObjects), mb(m.HeapUnused), mb(m.HeapFree), mb(m.HeapReleased), mb(m.Stacks), mb(m.Runtime), m.Goroutines)
}

var goMemSamples = []string{
	"/memory/classes/heap/objects:bytes",
	"/memory/classes/heap/free:bytes",
	"/memory/classes/heap/released:bytes",
	"/memory/classes/heap/unused:bytes",
	"/memory/classes/heap/stacks:bytes",
	"/memory/classes/os-stacks:bytes",
	"/memory/classes/metadata/mspan/inuse:bytes",
	"/memory/classes/metadata/mspan/free:bytes",
	"/memory/classes/metadata/mcache/inuse:bytes",
	"/memory/classes/metadata/mcache/free:bytes",
	"/memory/classes/metadata/other:bytes",
	"/memory/classes/profiling/buckets:bytes",
	"/memory/classes/other:bytes",
	"/sched/goroutines:goroutines",
	"/memory/classes/total:bytes",
	"/gc/heap/live:bytes",
}

// readGoMem reads the Go runtime's memory classes.
func readGoMem() goMem {
	s := make([]metrics.Sample, len(goMemSamples))
	for i, n := range goMemSamples {
		s[i].Name = n
	}
	metrics.Read(s)
	v := func(i int) uint64 {
		if s[i].Value.Kind() != metrics.KindUint64 {
			return 0
		}
		return s[i].Value.Uint64()
	}
	var m goMem
	m.HeapObjects, m.HeapFree, m.HeapReleased, m.HeapUnused = v(0), v(1), v(2), v(3)
	m.Stacks = v(4) + v(5)
	for i := 6; i <= 12; i++ {
		m.Runtime += v(i)
	}
	m.Goroutines = v(13)
	m.Total = v(14)
	m.HeapLive = v(15)
	return m
}

// afterEachGC calls f after every garbage collection from now on, in a
// goroutine of its own (a finalizer re-armed each cycle).
func afterEachGC(f func()) {
	type sentinel struct {
		p *int
		_ [16]byte // not a tiny allocation: its finalizer runs
	}
	var arm func()
	arm = func() {
		runtime.SetFinalizer(&sentinel{}, func(*sentinel) {
			f()
			arm()
		})
	}
	arm()
}
