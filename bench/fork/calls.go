package main

import (
	"context"
	"fmt"
	"os"
	"time"

	containerd "github.com/containerd/containerd/v2/client"

	"github.com/lazyfork/lazyfork/bench/internal/report"
	"github.com/lazyfork/lazyfork/integration/harness"
)

// runCallsOnly measures forks made one a call, as agents make them: a parent
// of heapMiB forked n times in succession, one fork per call (a new snapshot
// each), every fork kept. Per call it prints the call's restore phase
// (Result.Restore: batch layer, container, task create and start), its wall
// time and the shims serving the stack; then each fork's steps, the shims'
// PSS and each fork's memory with its share of them.
func runCallsOnly(heapMiB, n int) error {
	bin, cleanupBin, err := repoBinaries()
	if err != nil {
		return err
	}
	defer cleanupBin()
	b, err := newBenchWith(bin, n, 0, harness.Options{})
	if err != nil {
		return err
	}
	defer b.close()
	ctx := b.h.Context(context.Background())
	parent, err := b.startCounter(ctx, b.id(fmt.Sprintf("lf%d", heapMiB)), "io.containerd.lazyfork.v1", heapMiB)
	if parent != nil {
		defer b.remove(context.WithoutCancel(ctx), parent.Container)
	}
	if err != nil {
		return err
	}
	var ctrs []containerd.Container
	defer func() { b.removeAll(context.WithoutCancel(ctx), ctrs) }()
	var restores, walls []time.Duration
	rec := newStepRecorder()
	rec.begun = map[string]time.Time{}
	var t0 time.Time
	fmt.Printf("call  restore_ms  wall_ms  shims\n")
	for i := range n {
		t0 = time.Now()
		res, err := b.lf.Fork(ctx, parent.ID, 1, append(rec.opts(), b.logIO())...)
		wall := time.Since(t0)
		if err != nil {
			return fmt.Errorf("call %d: %w", i+1, err)
		}
		rec.begun[res.Forks[0].Container.ID()] = t0
		ctrs = append(ctrs, res.Forks[0].Container)
		restores = append(restores, res.Restore)
		walls = append(walls, wall)
		nShims, _, _ := b.env.ShimMemory()
		fmt.Printf("%4d  %10.1f  %7.1f  %5d\n", i+1, ms(res.Restore), ms(wall), nShims)
	}
	fmt.Printf("restore: first %.1f ms; calls 2-%d median %.1f ms, worst %.1f ms\n",
		ms(restores[0]), n, ms(report.Median(restores[1:])), ms(report.Max(restores[1:])))
	fmt.Printf("call wall: median %.1f ms, worst %.1f ms\n", ms(report.Median(walls)), ms(report.Max(walls)))
	fmt.Printf("each fork's steps, from its call's start (d: from the step before; s):\n")
	rec.print(os.Stdout, t0)
	nShims, shims, _ := b.env.ShimMemory()
	share := float64(shims.Pss) / float64(n+1) // the parent's shim counted with the forks'
	var mems []float64
	for _, c := range ctrs {
		if m, err := b.memory(ctx, c); err == nil {
			mems = append(mems, float64(m)+share)
		}
	}
	fmt.Printf("shims: %d for the parent and %d forks, PSS %.1f MB (%.2f MB a fork)\n", nShims, n, float64(shims.Pss)/1e6, share/1e6)
	fmt.Printf("a fork with its share of the shims: median %.2f MB, worst %.2f MB\n", report.Median(mems)/1e6, report.Max(mems)/1e6)
	if len(mems) != n {
		fmt.Fprintf(os.Stderr, "bench-fork: %d of %d forks' memory unread\n", n-len(mems), n)
	}
	return nil
}

func ms(d time.Duration) float64 { return float64(d.Microseconds()) / 1000 }
