// Package workloads holds the test programs LazyFork dumps, rewrites and restores,
// and the code that builds them and talks to them.
//
// Three programs, each a different way of managing memory:
//   - cheap.c: glibc malloc (brk heap, mmapped blocks, thread arenas that grow and
//     trim, calloc zero checks, mremap growth with and without a merged neighbour);
//   - pyheap.py: CPython with threads and a forked child process (stdlib only);
//   - goheap: Go, calling debug.FreeOSMemory every tick.
//
// The sources are embedded, so tools and tests build them anywhere (gcc and go at
// run time). Every program speaks the same line protocol on stdout:
//
//	tick N bad=B ...                         every tick
//	verify tick=N ok=0|1 ... marker=V ...    after SIGUSR1: a check of all its memory
//	marker tick=N value=V                    after SIGUSR2: a write into its heap
//
// so a test can tell that a copy continued where its parent was (its first tick
// follows the parent's), that its memory is intact (verify ok=1), and that a write
// in one copy is invisible to the others (their verify reports their own marker).
package workloads
