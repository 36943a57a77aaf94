package main

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"

	containerd "github.com/containerd/containerd/v2/client"
	"github.com/containerd/containerd/v2/pkg/cio"
	"golang.org/x/sys/unix"

	"github.com/lazyfork/lazyfork/bench/internal/ctrbench"
	"github.com/lazyfork/lazyfork/bench/internal/report"
	lfclient "github.com/lazyfork/lazyfork/client"
	"github.com/lazyfork/lazyfork/integration/harness"
	"github.com/lazyfork/lazyfork/internal/cgroupmem"
	"github.com/lazyfork/lazyfork/memfile"
)

type bench struct {
	env      *ctrbench.Env
	h        *harness.Containerd // env.H
	root     string              // LAZYFORK_ROOT (a private tmpfs)
	lf       *lfclient.Client
	nForks   int
	plainMax int
	m        *results
	seq      int
}

func newBench(bin string, nForks, plainMax int) (*bench, error) {
	return newBenchWith(bin, nForks, plainMax, harness.Options{})
}

func newBenchWith(bin string, nForks, plainMax int, opts harness.Options) (*bench, error) {
	env, lf, err := ctrbench.SetupLazyForkWith(context.Background(), bin, opts, clientOpts...)
	if err != nil {
		return nil, err
	}
	return &bench{env: env, h: env.H, root: env.Root, lf: lf, nForks: nForks, plainMax: plainMax, m: &results{}}, nil
}

func (b *bench) close() {
	if err := b.env.Close(); err != nil {
		fmt.Fprintln(os.Stderr, "bench-fork: teardown:", err)
	}
}

func (b *bench) id(prefix string) string {
	b.seq++
	return fmt.Sprintf("%s-%d", prefix, b.seq)
}

// startCounter starts a counter.py container on runtime, filled and counting.
func (b *bench) startCounter(ctx context.Context, id, runtime string, heapMiB int) (*ctrbench.Counter, error) {
	ctx, cancel := context.WithTimeout(ctx, 6*time.Minute)
	defer cancel()
	return b.env.StartCounter(ctx, id, heapMiB, harness.ContainerConfig{Runtime: runtime})
}

// remove deletes tasks and containers (with snapshots), ignoring what is gone.
func (b *bench) remove(ctx context.Context, ctrs ...containerd.Container) {
	ctx = b.h.Context(ctx)
	for _, c := range ctrs {
		if c == nil {
			continue
		}
		if t, err := c.Task(ctx, nil); err == nil {
			_, _ = t.Delete(ctx, containerd.WithProcessKill)
		}
		_ = c.Delete(ctx, containerd.WithSnapshotCleanup)
	}
}

// memory is a container's cgroup memory usage in bytes, from the cgroups path
// of its spec (LazyFork's forks are not made by the harness).
func (b *bench) memory(ctx context.Context, ctr containerd.Container) (int64, error) {
	spec, err := ctr.Spec(b.h.Context(ctx))
	if err != nil {
		return 0, err
	}
	return cgroupmem.Usage(spec.Linux.CgroupsPath)
}

// shmem is the tmpfs (memory-file) bytes charged to a container's cgroup.
func (b *bench) shmem(ctx context.Context, ctr containerd.Container) int64 {
	spec, err := ctr.Spec(b.h.Context(ctx))
	if err != nil {
		return 0
	}
	st, err := cgroupmem.Stat(spec.Linux.CgroupsPath)
	if err != nil {
		return 0
	}
	return int64(st["shmem"])
}

func (b *bench) logIO() lfclient.ForkOpt {
	return lfclient.WithIO(func(id string) cio.Creator { return cio.LogFile(b.h.TaskLogPath(id)) })
}

// lazyfork measures LazyFork forks of a counter holding heapMiB.
func (b *bench) lazyfork(ctx context.Context, heapMiB int) error {
	ctx = b.h.Context(ctx)
	m := b.m
	sys := "lazyfork"
	parent, err := b.startCounter(ctx, b.id(fmt.Sprintf("lf%d", heapMiB)), "io.containerd.lazyfork.v1", heapMiB)
	var made []containerd.Container
	defer func() { b.remove(context.WithoutCancel(ctx), made...) }()
	if parent != nil {
		made = append(made, parent.Container)
	}
	if err != nil {
		return err
	}
	if pm, err := b.memory(ctx, parent.Container); err == nil {
		m.add(heapMiB, sys, "parent_memory", float64(pm), "B")
	}

	// The snapshot and one fork.
	res, err := b.lf.Fork(ctx, parent.ID, 1, lfclient.KeepSnapshot(), b.logIO())
	if err != nil {
		return err
	}
	defer b.lf.RemoveSnapshot(context.WithoutCancel(ctx), res.Snapshot)
	made = append(made, res.Forks[0].Container)
	m.addDur(heapMiB, sys, "snapshot_pause", res.Paused)
	m.addDur(heapMiB, sys, "snapshot_dump_rewrite", res.Checkpoint)
	m.addDur(heapMiB, sys, "snapshot_copy_upper", res.CopyUpper)
	m.addDur(heapMiB, sys, "restore_1", res.Forks[0].Restore)
	if mem, err := b.memory(ctx, res.Forks[0].Container); err == nil {
		m.add(heapMiB, sys, "memory_after_restore_1", float64(mem), "B")
	}
	if total, pages, err := ctrbench.ImageSize(res.Snapshot); err == nil {
		m.add(heapMiB, sys, "snapshot_image", float64(total), "B")
		m.add(heapMiB, sys, "snapshot_image_pages", float64(pages), "B")
	}
	// The family's memory files (tmpfs), shared by the parent and every fork.
	var memFileBytes int64
	for _, size := range memFiles(filepath.Join(b.root, "mem", res.Family)) {
		memFileBytes += size
	}
	m.add(heapMiB, sys, "memory_files", float64(memFileBytes), "B")

	// One fork at a time, seqRestores times, each removed before the next:
	// the per-heap target is a median, and one restore here varies
	// by 10-20 ms (restore_1, the call's first, also starts a shim).
	var seq []time.Duration
	for range seqRestores {
		fs, err := b.lf.RestoreForks(ctx, parent.ID, res.Snapshot, 1, b.logIO())
		for _, f := range fs {
			b.remove(context.WithoutCancel(ctx), f.Container)
		}
		if err != nil {
			return err
		}
		seq = append(seq, fs[0].Restore)
	}
	m.addDur(heapMiB, sys, "restore_seq_median", report.Median(seq))
	m.addDur(heapMiB, sys, "restore_seq_max", report.Max(seq))

	// n forks at once from the same snapshot.
	t0 := time.Now()
	rec := newStepRecorder()
	opts := append(rec.opts(), b.logIO())
	if p, _ := strconv.Atoi(os.Getenv("BENCH_PARALLEL")); p > 0 {
		opts = append(opts, lfclient.WithParallel(p))
	}
	forks, err := b.lf.RestoreForks(ctx, parent.ID, res.Snapshot, b.nForks, opts...)
	wall := time.Since(t0)
	for _, f := range forks {
		made = append(made, f.Container)
	}
	if err != nil {
		return err
	}
	var each []time.Duration
	var mems []float64
	for _, f := range forks {
		each = append(each, f.Restore)
		if mem, err := b.memory(ctx, f.Container); err == nil {
			mems = append(mems, float64(mem))
		}
	}
	m.addDur(heapMiB, sys, fmt.Sprintf("restore_%d_median", b.nForks), report.Median(each))
	m.addDur(heapMiB, sys, fmt.Sprintf("restore_%d_max", b.nForks), report.Max(each))
	m.addDur(heapMiB, sys, fmt.Sprintf("restore_%d_wall_incl_rootfs", b.nForks), wall)
	fmt.Fprintf(os.Stderr, "bench-fork: %d forks at once, %d MiB: %.3f s wall, load %s; each fork's steps:\n", b.nForks, heapMiB, wall.Seconds(), loadavg())
	rec.print(os.Stderr, t0)
	m.add(heapMiB, sys, "memory_after_restore_median", report.Median(mems), "B")
	m.add(heapMiB, sys, "memory_after_restore_max", report.Max(mems), "B")

	// 5 s of running, each fork writing a page a second (the tick loop reads).
	for s := 0; s < 5; s++ {
		for _, f := range forks {
			_ = f.Task.Kill(ctx, syscall.SIGUSR2)
		}
		time.Sleep(time.Second)
	}
	mems = mems[:0]
	for _, f := range forks {
		if mem, err := b.memory(ctx, f.Container); err == nil {
			mems = append(mems, float64(mem))
		}
	}
	m.add(heapMiB, sys, "memory_after_5s_median", report.Median(mems), "B")
	m.add(heapMiB, sys, "memory_after_5s_max", report.Max(mems), "B")
	nShims, shims, _ := b.env.ShimMemory()
	served := b.nForks + 2 // the parent, its first fork, the n forks
	m.add(heapMiB, sys, "shim_processes", float64(nShims), "")
	m.add(heapMiB, sys, "shim_rss_per_fork", float64(shims.RSS)/float64(served), "B")
	m.add(heapMiB, sys, "shim_pss_per_fork", float64(shims.Pss)/float64(served), "B")
	// What a user pays: each fork with its share of the shims (worst fork),
	// and the n forks together with the memory file and the shims.
	m.add(heapMiB, sys, "memory_per_fork_max_incl_shim_share", report.Max(mems)+float64(shims.Pss)/float64(served), "B")
	// The usage holds pages the kernel charged ahead of need (per-CPU charge
	// stock, see forkMem.precharge): read the forks again once their page
	// statistics are flushed, and count what each holds.
	time.Sleep(statsFlush)
	var fctrs []containerd.Container
	for _, f := range forks {
		fctrs = append(fctrs, f.Container)
	}
	fms := b.forkMems(ctx, fctrs)
	var held []float64
	var ahead float64
	for _, f := range fms {
		held = append(held, float64(f.held()))
		ahead = max(ahead, float64(f.precharge()))
	}
	m.add(heapMiB, sys, "memory_held_median", report.Median(held), "B")
	m.add(heapMiB, sys, "memory_held_max", report.Max(held), "B")
	m.add(heapMiB, sys, "memory_charged_ahead_max", ahead, "B")
	m.add(heapMiB, sys, "memory_per_fork_max_held_incl_shim_share", report.Max(held)+float64(shims.Pss)/float64(served), "B")
	fmt.Printf("memory of %d forks of %d MiB after 5 s (+%.1f s), and of the shims:\n", b.nForks, heapMiB, statsFlush.Seconds())
	printComposition(os.Stdout, fms, b.h.Address)
	// Memory-file pages charged to these cgroups (shmem: the parent's, whose
	// heap moved onto the file) are counted once, as the file.
	var sum, shmem float64
	for _, v := range mems {
		sum += v
	}
	for _, f := range forks {
		shmem += float64(b.shmem(ctx, f.Container))
	}
	pm, _ := b.memory(ctx, parent.Container)
	shmem += float64(b.shmem(ctx, parent.Container))
	m.add(heapMiB, sys, "parent_memory_after_forks", float64(pm), "B")
	m.add(heapMiB, sys, fmt.Sprintf("parent_%d_forks_memory_file_shims", b.nForks),
		float64(pm)+sum+float64(memFileBytes)+float64(shims.Pss)-min(shmem, float64(memFileBytes)), "B")

	// A fork of a fork: the snapshot of a fork that wrote 5 pages.
	famDir := filepath.Join(b.root, "mem", res.Family)
	before := memFiles(famDir)
	child := forks[0]
	res2, err := b.lf.Fork(ctx, child.Container.ID(), 1, lfclient.KeepSnapshot(), b.logIO())
	if err != nil {
		return fmt.Errorf("fork of a fork: %w", err)
	}
	defer b.lf.RemoveSnapshot(context.WithoutCancel(ctx), res2.Snapshot)
	made = append(made, res2.Forks[0].Container)
	var delta int64
	for name, size := range memFiles(famDir) {
		if _, ok := before[name]; !ok {
			delta += size
		}
	}
	m.addDur(heapMiB, sys, "fork_of_fork_pause", res2.Paused)
	m.addDur(heapMiB, sys, "fork_of_fork_dump_rewrite", res2.Checkpoint)
	m.add(heapMiB, sys, "fork_of_fork_new_memory_files", float64(delta), "B")
	if total, _, err := ctrbench.ImageSize(res2.Snapshot); err == nil {
		m.add(heapMiB, sys, "fork_of_fork_snapshot_image", float64(total), "B")
	}
	m.addDur(heapMiB, sys, "fork_of_fork_restore", res2.Forks[0].Restore)
	if mem, err := b.memory(ctx, res2.Forks[0].Container); err == nil {
		m.add(heapMiB, sys, "fork_of_fork_memory_after_restore", float64(mem), "B")
	}
	return nil
}

// plain measures runc's own checkpoint/restore of the same workload.
func (b *bench) plain(ctx context.Context, heapMiB int) error {
	ctx = b.h.Context(ctx)
	m := b.m
	sys := "plain"
	parent, err := b.startCounter(ctx, b.id(fmt.Sprintf("pl%d", heapMiB)), harness.RuncRuntime, heapMiB)
	var made []containerd.Container
	defer func() { b.remove(context.WithoutCancel(ctx), made...) }()
	if parent != nil {
		made = append(made, parent.Container)
	}
	if err != nil {
		return err
	}
	dir, err := b.h.TempDir("plain-ckpt-")
	if err != nil {
		return err
	}
	defer os.RemoveAll(dir)
	paused, err := ctrbench.PausedCheckpoint(ctx, b.h.Client(), parent, dir)
	if err != nil {
		return err
	}
	m.addDur(heapMiB, sys, "snapshot_pause", paused)
	if total, pages, err := ctrbench.ImageSize(dir); err == nil {
		m.add(heapMiB, sys, "snapshot_image", float64(total), "B")
		m.add(heapMiB, sys, "snapshot_image_pages", float64(pages), "B")
	}

	// n copies at once, each timed from task create to running.
	restore := func(n int) ([]containerd.Container, []time.Duration, error) {
		copies, _, err := b.env.RestoreCopies(ctx, parent.Container, dir, b.id(fmt.Sprintf("pl%dr", heapMiB)), n)
		var ctrs []containerd.Container
		var each []time.Duration
		for _, c := range copies {
			if c != nil && c.Container != nil {
				ctrs = append(ctrs, c.Container)
				each = append(each, c.Restore)
			}
		}
		return ctrs, each, err
	}
	one, each, err := restore(1)
	made = append(made, one...)
	if err != nil {
		return err
	}
	m.addDur(heapMiB, sys, "restore_1", each[0])
	if mem, err := b.memory(ctx, one[0]); err == nil {
		m.add(heapMiB, sys, "memory_after_restore_1", float64(mem), "B")
	}
	b.remove(ctx, one...)
	if heapMiB > b.plainMax {
		return nil
	}
	many, each, err := restore(b.nForks)
	made = append(made, many...)
	if err != nil {
		return err
	}
	var mems []float64
	for _, c := range many {
		if mem, err := b.memory(ctx, c); err == nil {
			mems = append(mems, float64(mem))
		}
	}
	m.addDur(heapMiB, sys, fmt.Sprintf("restore_%d_median", b.nForks), report.Median(each))
	m.addDur(heapMiB, sys, fmt.Sprintf("restore_%d_max", b.nForks), report.Max(each))
	m.add(heapMiB, sys, "memory_after_restore_median", report.Median(mems), "B")
	return nil
}

// memFiles maps a family's memory files to the bytes they occupy on the tmpfs.
func memFiles(dir string) map[string]int64 {
	out := map[string]int64{}
	ents, _ := os.ReadDir(dir)
	for _, e := range ents {
		if !strings.HasSuffix(e.Name(), memfile.FileExt) {
			continue
		}
		var st unix.Stat_t
		if unix.Stat(filepath.Join(dir, e.Name()), &st) == nil {
			out[e.Name()] = st.Blocks * 512
		}
	}
	return out
}
