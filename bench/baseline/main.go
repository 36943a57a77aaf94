// Command baseline measures what LazyFork must beat: plain runc + CRIU
// checkpoint/restore of a python container holding a 256 MiB heap, through a
// private containerd and the containerd Go client.
//
// It prints, as a table, and writes as long-format CSV (default
// bench/results/baseline.csv) plus a PNG plot beside it:
//   - the leave-running checkpoint to an image directory (time, image size);
//   - the restore of 1 copy (task create -> running) and its cgroup memory;
//   - the restore of N copies at once (wall, each copy's time) and each copy's
//     cgroup memory.
//
// Every copy is checked: it continues counting after the checkpoint tick and its
// heap verifies. Run as root: `make bench-baseline` (go run ./bench/baseline).
package main

import (
	"context"
	"flag"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"time"

	"github.com/lazyfork/lazyfork/bench/internal/ctrbench"
	"github.com/lazyfork/lazyfork/bench/internal/report"
	"github.com/lazyfork/lazyfork/integration/harness"
	"github.com/lazyfork/lazyfork/integration/workloads"
)

func main() {
	heap := flag.Int("heap", 256, "counter heap in MiB")
	copies := flag.Int("copies", 10, "copies restored at once")
	out := flag.String("out", "", "CSV path (default <repo>/bench/results/baseline.csv)")
	flag.Parse()
	if *out == "" {
		root, err := harness.RepoRoot()
		if err != nil {
			fail(err)
		}
		*out = filepath.Join(root, "bench", "results", "baseline.csv")
	}
	if os.Geteuid() != 0 {
		fail(fmt.Errorf("run as root (private containerd, runc, CRIU)"))
	}
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Minute)
	defer cancel()
	res, err := run(ctx, *heap, *copies)
	if err != nil {
		fail(err)
	}
	res.print()
	if err := res.m.Table().WriteCSV(*out); err != nil {
		fail(err)
	}
	png := strings.TrimSuffix(*out, ".csv") + ".png"
	if err := res.plot(png); err != nil {
		fail(err)
	}
	fmt.Printf("\nwrote %s and %s\n", *out, png)
}

func fail(err error) {
	fmt.Fprintln(os.Stderr, "bench-baseline:", err)
	os.Exit(1)
}

type result struct {
	heapMiB    int
	parentMem  int64
	ckpt       time.Duration
	imageBytes int64
	pageBytes  int64
	one        *ctrbench.Copy
	oneMem     int64
	many       []*ctrbench.Copy
	manyWall   time.Duration
	manyMem    []int64
	m          report.Measurements
}

const scenario = "baseline"

func run(ctx context.Context, heapMiB, n int) (*result, error) {
	env, err := ctrbench.Setup(ctx, harness.Options{}, "")
	if err != nil {
		return nil, err
	}
	defer func() {
		if err := env.Close(); err != nil {
			fmt.Fprintln(os.Stderr, "bench-baseline: teardown:", err)
		}
	}()
	ctx = env.H.Context(ctx)
	r := &result{heapMiB: heapMiB}

	parent, err := env.StartCounter(ctx, "parent", heapMiB, harness.ContainerConfig{})
	if err != nil {
		return nil, fmt.Errorf("parent: %w", err)
	}
	if r.parentMem, err = env.Memory(parent.ID); err != nil {
		return nil, err
	}
	r.m.Add(scenario, "parent_memory_bytes", parent.ID, float64(r.parentMem), "bytes")

	dir, err := env.H.TempDir("ckpt-")
	if err != nil {
		return nil, err
	}
	before, _ := workloads.LastTick(parent.Log)
	if r.ckpt, err = ctrbench.Checkpoint(ctx, parent.Task, dir); err != nil {
		return nil, err
	}
	if r.imageBytes, r.pageBytes, err = ctrbench.ImageSize(dir); err != nil {
		return nil, err
	}
	r.m.Add(scenario, "checkpoint_s", parent.ID, r.ckpt.Seconds(), "s")
	r.m.Add(scenario, "checkpoint_image_bytes", parent.ID, float64(r.imageBytes), "bytes")
	r.m.Add(scenario, "checkpoint_pages_bytes", parent.ID, float64(r.pageBytes), "bytes")

	// One copy.
	one, _, err := env.RestoreCopies(ctx, parent.Container, dir, "one", 1)
	if err != nil {
		return nil, fmt.Errorf("restore 1: %w", err)
	}
	r.one = one[0]
	if err := check(ctx, r.one, before); err != nil {
		return nil, err
	}
	if r.oneMem, err = env.Memory(r.one.ID); err != nil {
		return nil, err
	}
	r.m.Add(scenario, "restore1_s", r.one.ID, r.one.Start.Seconds(), "s")
	r.m.Add(scenario, "restore1_memory_bytes", r.one.ID, float64(r.oneMem), "bytes")
	if err := env.Remove(ctx, &r.one.Counter); err != nil {
		return nil, err
	}

	// N copies at once.
	r.many, r.manyWall, err = env.RestoreCopies(ctx, parent.Container, dir, "many", n)
	if err != nil {
		return nil, fmt.Errorf("restore %d: %w", n, err)
	}
	r.m.Add(scenario, fmt.Sprintf("restore%d_wall_s", n), "", r.manyWall.Seconds(), "s")
	for _, c := range r.many {
		mem, err := env.Memory(c.ID)
		if err != nil {
			return nil, err
		}
		r.manyMem = append(r.manyMem, mem)
		r.m.Add(scenario, fmt.Sprintf("restore%d_s", n), c.ID, c.Start.Seconds(), "s")
		r.m.Add(scenario, fmt.Sprintf("restore%d_memory_bytes", n), c.ID, float64(mem), "bytes")
	}
	for _, c := range r.many {
		if err := check(ctx, c, before); err != nil {
			return nil, err
		}
	}
	return r, nil
}

// check proves a copy is a real continuation: it resumed after the tick seen
// before the checkpoint, keeps counting, and its heap verifies.
func check(ctx context.Context, c *ctrbench.Copy, before int) error {
	if c.FirstTick <= before {
		return fmt.Errorf("copy %s resumed at tick %d, not after the checkpoint (%d)", c.ID, c.FirstTick, before)
	}
	if _, err := workloads.WaitTickAbove(ctx, c.Log, c.FirstTick); err != nil {
		return fmt.Errorf("copy %s: %w", c.ID, err)
	}
	if _, err := workloads.Verify(ctx, c.Task, c.Log); err != nil {
		return fmt.Errorf("copy %s: heap: %w", c.ID, err)
	}
	return nil
}

func (r *result) print() {
	starts := copyStarts(r.many)
	var total, minMem, maxMem int64
	for i := range r.many {
		m := r.manyMem[i]
		total += m
		if i == 0 || m < minMem {
			minMem = m
		}
		maxMem = max(maxMem, m)
	}
	t := &report.Table{
		Title:   fmt.Sprintf("Baseline: plain runc + CRIU, python container holding %d MiB (containerd Go client)", r.heapMiB),
		Columns: []string{"step", "time", "memory (cgroup)", "notes"},
	}
	t.Add("parent running", "", report.MB(r.parentMem), "")
	t.Add("checkpoint, leave running", fmt.Sprintf("%.3f s", r.ckpt.Seconds()), "",
		fmt.Sprintf("image %s (pages %s)", report.MB(r.imageBytes), report.MB(r.pageBytes)))
	t.Add("restore 1 copy", fmt.Sprintf("%.3f s", r.one.Start.Seconds()), report.MB(r.oneMem), "task create -> running")
	t.Add(fmt.Sprintf("restore %d copies at once", len(r.many)), fmt.Sprintf("%.3f s wall", r.manyWall.Seconds()),
		fmt.Sprintf("%s total", report.MB(total)),
		fmt.Sprintf("per copy: median %.3f s, max %.3f s", ctrbench.Median(starts).Seconds(), ctrbench.Max(starts).Seconds()))
	t.Add("  memory of each copy", "", fmt.Sprintf("%s .. %s", report.MB(minMem), report.MB(maxMem)), "none shared")
	for i, c := range r.many {
		t.Add("  "+c.ID, fmt.Sprintf("%.3f s", c.Start.Seconds()), report.MB(r.manyMem[i]), fmt.Sprintf("first tick %d", c.FirstTick))
	}
	t.Print(os.Stdout)
}

func copyStarts(cs []*ctrbench.Copy) []time.Duration {
	ds := make([]time.Duration, len(cs))
	for i, c := range cs {
		ds[i] = c.Start
	}
	return ds
}
