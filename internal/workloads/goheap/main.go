// Command goheap is a Go workload for LazyFork's fidelity tests: a heap of patterned
// blocks that churns and calls debug.FreeOSMemory every tick, so the runtime keeps
// returning memory to the kernel (MADV_DONTNEED) and reusing it.
//
// Protocol, as for cheap.c: "tick N bad=B urandom=X" every tick, X being 8
// bytes of crypto/rand drawn on the main goroutine's thread (locked, so its
// vDSO getrandom state is always the same one: two copies that share that
// state print the same X); SIGUSR1 checks everything
// (fresh allocations must read zeros) and prints "verify tick=N ok=0|1 ...";
// SIGUSR2 writes a new marker and rewrites block 0, printing "marker tick=N value=V".
//
// Usage: goheap [-m heapMiB] [-t tickMs]
package main

import (
	crand "crypto/rand"
	"encoding/binary"
	"flag"
	"fmt"
	"math/rand/v2"
	"os"
	"os/signal"
	"runtime"
	"runtime/debug"
	"syscall"
	"time"
)

const block = 256 << 10

func mix(x uint64) uint64 {
	x ^= x >> 31
	x *= 0x7fb5d329728ea185
	x ^= x >> 27
	x *= 0x81dadef4bc2dd44d
	x ^= x >> 33
	return x
}

func fill(b []byte, id, gen uint64) {
	seed := mix(id*0x9e3779b97f4a7c15+gen) | 1
	for i := 0; i+8 <= len(b); i += 8 {
		binary.LittleEndian.PutUint64(b[i:], seed+uint64(i/8)*0xd6e8feb86659fd93)
	}
}

func bad(b []byte, id, gen uint64) (n uint64) {
	seed := mix(id*0x9e3779b97f4a7c15+gen) | 1
	for i := 0; i+8 <= len(b); i += 8 {
		if binary.LittleEndian.Uint64(b[i:]) != seed+uint64(i/8)*0xd6e8feb86659fd93 {
			n++
		}
	}
	return n
}

func nonzero(b []byte) (n uint64) {
	for _, c := range b {
		if c != 0 {
			n++
		}
	}
	return n
}

func main() {
	mib := flag.Int("m", 64, "heap in MiB")
	tickMs := flag.Int("t", 100, "tick in milliseconds")
	flag.Parse()
	runtime.LockOSThread()

	n := *mib << 20 / block
	blocks := make([][]byte, n)
	gens := make([]uint64, n)
	for i := range blocks {
		blocks[i] = make([]byte, block)
		fill(blocks[i], uint64(i), 0)
	}
	marker := make([]byte, 4096)
	var markerValue, badCount, zeroBad uint64

	sig := make(chan os.Signal, 4)
	signal.Notify(sig, syscall.SIGUSR1, syscall.SIGUSR2)
	rnd := rand.New(rand.NewPCG(1, 2))
	fmt.Printf("ready pid=%d heap=%d blocks=%d\n", os.Getpid(), n*block, n)

	// Churn: replace a few blocks each tick (the old ones become garbage), and keep
	// a short-lived burst whose fresh memory must read zeros.
	cursor := 0
	tick := time.NewTicker(time.Duration(*tickMs) * time.Millisecond)
	for t := uint64(1); ; t++ {
		for k := 0; k < 4; k++ {
			badCount += bad(blocks[cursor], uint64(cursor), gens[cursor])
			cursor = (cursor + 1) % n
		}
		for k := 0; k < 4; k++ {
			i := 1 + rnd.IntN(n-1)
			badCount += bad(blocks[i], uint64(i), gens[i])
			nb := make([]byte, block)
			zeroBad += nonzero(nb)
			gens[i]++
			fill(nb, uint64(i), gens[i])
			blocks[i] = nb
		}
		burst := make([][]byte, 32)
		for k := range burst {
			burst[k] = make([]byte, 64<<10)
			zeroBad += nonzero(burst[k])
			fill(burst[k], 1<<40+uint64(k), t)
		}
		for k := range burst {
			badCount += bad(burst[k], 1<<40+uint64(k), t)
		}
		burst = nil
		debug.FreeOSMemory()
		var ur [8]byte
		crand.Read(ur[:])
		fmt.Printf("tick %d bad=%d urandom=%x\n", t, badCount+zeroBad, ur)
		select {
		case <-tick.C:
		case s := <-sig:
			switch s {
			case syscall.SIGUSR2:
				markerValue = rnd.Uint64()>>1 | 1
				binary.LittleEndian.PutUint64(marker, markerValue)
				gens[0]++
				fill(blocks[0], 0, gens[0])
				fmt.Printf("marker tick=%d value=%d\n", t, markerValue)
			case syscall.SIGUSR1:
				start := time.Now()
				var b, checked uint64
				for i := range blocks {
					b += bad(blocks[i], uint64(i), gens[i])
					checked += uint64(len(blocks[i]))
				}
				seen := binary.LittleEndian.Uint64(marker)
				if seen != markerValue {
					b++
				}
				fresh := make([]byte, 8<<20)
				zeroBad += nonzero(fresh)
				total := b + badCount
				ok := 0
				if total == 0 && zeroBad == 0 {
					ok = 1
				}
				fmt.Printf("verify tick=%d ok=%d checked=%d bad=%d calloc_bad=%d marker=%d ms=%d\n",
					t, ok, checked, total, zeroBad, seen, time.Since(start).Milliseconds())
			}
		}
	}
}
