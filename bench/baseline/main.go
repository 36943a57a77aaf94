// Command baseline measures what LazyFork must beat: plain runc + CRIU
// checkpoint/restore of a python container holding a 256 MiB heap, through a
// private containerd and the containerd Go client.
//
// It prints a table, and writes a long-format CSV (default
// bench/results/baseline.csv) and a PNG plot beside it:
//   - the leave-running checkpoint to an image directory (time, image size);
//   - the restore of 1 copy (task create -> running) and its cgroup memory;
//   - the restore of N copies at once (wall, each copy's time) and each copy's
//     cgroup memory.
//
// With -runs R the checkpoint and both restores are repeated R times on the same
// parent and the table shows medians (the CSV has every run). Every copy is
// checked: it continues counting after the checkpoint and its heap verifies.
// Run as root: `make bench-baseline` (cd bench && go run ./baseline).
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
	runs := flag.Int("runs", 3, "repetitions of checkpoint + restores (medians reported)")
	out := flag.String("out", "", "CSV path (default <repo>/bench/results/baseline.csv); the PNG goes beside it")
	flag.Parse()
	if *heap < 1 || *copies < 1 || *runs < 1 {
		fail(fmt.Errorf("-heap, -copies and -runs must be at least 1"))
	}
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
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Minute)
	defer cancel()
	res, err := run(ctx, *heap, *copies, *runs)
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

// round is one checkpoint + restore of 1 + restore of N.
type round struct {
	ckpt       time.Duration
	imageBytes int64
	pageBytes  int64
	one        *ctrbench.Copy
	oneMem     int64
	many       []*ctrbench.Copy
	manyWall   time.Duration
	manyMem    []int64
	shims      int
	shimMem    ctrbench.ProcMemory // all shims while the N copies and the parent run
}

type result struct {
	heapMiB   int
	copies    int
	parentMem int64
	load      [2]string // load average before and after
	rounds    []*round
	m         report.Measurements
}

const scenario = "baseline"

func run(ctx context.Context, heapMiB, n, runs int) (*result, error) {
	r := &result{heapMiB: heapMiB, copies: n}
	r.load[0] = loadavg()
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

	parent, err := env.StartCounter(ctx, "parent", heapMiB, harness.ContainerConfig{})
	if err != nil {
		return nil, fmt.Errorf("parent: %w", err)
	}
	if r.parentMem, err = env.Memory(parent.ID); err != nil {
		return nil, err
	}
	r.m.Add(scenario, "parent_memory_bytes", parent.ID, float64(r.parentMem), "bytes")
	for k := 1; k <= runs; k++ {
		rd, err := runRound(ctx, env, parent, n, k, &r.m)
		if err != nil {
			return nil, fmt.Errorf("run %d: %w", k, err)
		}
		r.rounds = append(r.rounds, rd)
	}
	r.load[1] = loadavg()
	return r, nil
}

func runRound(ctx context.Context, env *ctrbench.Env, parent *ctrbench.Counter, n, k int, m *report.Measurements) (*round, error) {
	rd := &round{}
	sub := func(s string) string { return fmt.Sprintf("run%d/%s", k, s) }
	dir, err := env.H.TempDir("ckpt-")
	if err != nil {
		return nil, err
	}
	defer os.RemoveAll(dir)
	before, _ := workloads.LastTick(parent.Log)
	if rd.ckpt, err = ctrbench.Checkpoint(ctx, parent.Task, dir); err != nil {
		return nil, err
	}
	if rd.imageBytes, rd.pageBytes, err = ctrbench.ImageSize(dir); err != nil {
		return nil, err
	}
	m.Add(scenario, "checkpoint_s", sub(parent.ID), rd.ckpt.Seconds(), "s")
	m.Add(scenario, "checkpoint_image_bytes", sub(parent.ID), float64(rd.imageBytes), "bytes")
	m.Add(scenario, "checkpoint_pages_bytes", sub(parent.ID), float64(rd.pageBytes), "bytes")

	one, _, err := env.RestoreCopies(ctx, parent.Container, dir, fmt.Sprintf("r%d-one", k), 1)
	if err != nil {
		return nil, fmt.Errorf("restore 1: %w", err)
	}
	rd.one = one[0]
	if rd.oneMem, err = env.Memory(rd.one.ID); err != nil {
		return nil, err
	}
	if err := check(ctx, rd.one, before); err != nil {
		return nil, err
	}
	m.Add(scenario, "restore1_s", sub(rd.one.ID), rd.one.Restore.Seconds(), "s")
	m.Add(scenario, "restore1_create_s", sub(rd.one.ID), rd.one.Create.Seconds(), "s")
	m.Add(scenario, "restore1_start_s", sub(rd.one.ID), rd.one.Run.Seconds(), "s")
	m.Add(scenario, "restore1_memory_bytes", sub(rd.one.ID), float64(rd.oneMem), "bytes")
	if err := env.Remove(ctx, &rd.one.Counter); err != nil {
		return nil, err
	}

	rd.many, rd.manyWall, err = env.RestoreCopies(ctx, parent.Container, dir, fmt.Sprintf("r%d-many", k), n)
	if err != nil {
		return nil, fmt.Errorf("restore %d: %w", n, err)
	}
	m.Add(scenario, fmt.Sprintf("restore%d_wall_s", n), sub(""), rd.manyWall.Seconds(), "s")
	for _, c := range rd.many {
		mem, err := env.Memory(c.ID)
		if err != nil {
			return nil, err
		}
		rd.manyMem = append(rd.manyMem, mem)
		m.Add(scenario, fmt.Sprintf("restore%d_s", n), sub(c.ID), c.Restore.Seconds(), "s")
		m.Add(scenario, fmt.Sprintf("restore%d_memory_bytes", n), sub(c.ID), float64(mem), "bytes")
	}
	if rd.shims, rd.shimMem, err = env.ShimMemory(); err != nil {
		return nil, err
	}
	m.Add(scenario, "shims", sub(""), float64(rd.shims), "count")
	m.Add(scenario, "shim_rss_bytes", sub(""), float64(rd.shimMem.RSS), "bytes")
	m.Add(scenario, "shim_rss_anon_bytes", sub(""), float64(rd.shimMem.RssAnon), "bytes")
	for _, c := range rd.many {
		if err := check(ctx, c, before); err != nil {
			return nil, err
		}
	}
	for _, c := range rd.many {
		if err := env.Remove(ctx, &c.Counter); err != nil {
			return nil, err
		}
	}
	return rd, nil
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

// medians over rounds of a per-round duration.
func (r *result) median(f func(*round) time.Duration) (med, lo, hi time.Duration) {
	ds := make([]time.Duration, len(r.rounds))
	for i, rd := range r.rounds {
		ds[i] = f(rd)
	}
	lo = ds[0]
	for _, d := range ds {
		lo = min(lo, d)
	}
	return report.Median(ds), lo, report.Max(ds)
}

func secs(med, lo, hi time.Duration, runs int) string {
	if runs == 1 {
		return fmt.Sprintf("%.3f s", med.Seconds())
	}
	return fmt.Sprintf("%.3f s (%.2f-%.2f)", med.Seconds(), lo.Seconds(), hi.Seconds())
}

func (r *result) print() {
	runs := len(r.rounds)
	last := r.rounds[runs-1]
	var total, minMem, maxMem int64
	for i, m := range last.manyMem {
		total += m
		if i == 0 || m < minMem {
			minMem = m
		}
		maxMem = max(maxMem, m)
	}
	title := fmt.Sprintf("Baseline: plain runc + CRIU, python container holding %d MiB (containerd Go client)", r.heapMiB)
	if runs > 1 {
		title += fmt.Sprintf("\ntimes: median of %d runs (min-max)", runs)
	}
	title += fmt.Sprintf("; load average before %s, after %s", r.load[0], r.load[1])
	t := &report.Table{Title: title, Columns: []string{"step", "time", "memory (cgroup)", "notes"}}
	t.Add("parent running", "", report.MB(r.parentMem), "")
	med, lo, hi := r.median(func(rd *round) time.Duration { return rd.ckpt })
	t.Add("checkpoint, leave running", secs(med, lo, hi, runs), "",
		fmt.Sprintf("image %s (pages %s)", report.MB(last.imageBytes), report.MB(last.pageBytes)))
	med, lo, hi = r.median(func(rd *round) time.Duration { return rd.one.Restore })
	t.Add("restore 1 copy", secs(med, lo, hi, runs), report.MB(last.oneMem),
		fmt.Sprintf("task create -> running (last run: create %.3f s, start %.3f s)", last.one.Create.Seconds(), last.one.Run.Seconds()))
	med, lo, hi = r.median(func(rd *round) time.Duration { return rd.manyWall })
	pmed, _, _ := r.median(func(rd *round) time.Duration { return report.Median(restoreTimes(rd.many)) })
	pmax, _, _ := r.median(func(rd *round) time.Duration { return report.Max(restoreTimes(rd.many)) })
	t.Add(fmt.Sprintf("restore %d copies at once", r.copies), secs(med, lo, hi, runs)+" wall",
		fmt.Sprintf("%s total", report.MB(total)),
		fmt.Sprintf("per copy: median %.3f s, max %.3f s", pmed.Seconds(), pmax.Seconds()))
	t.Add("  memory of each copy", "", fmt.Sprintf("%s .. %s", report.MB(minMem), report.MB(maxMem)), "none shared")
	if last.shims > 0 {
		t.Add("  shim processes", "", fmt.Sprintf("%s RSS each", report.MB(last.shimMem.RSS/int64(last.shims))),
			fmt.Sprintf("%d shims (parent + copies), %s private (RssAnon) each, outside the cgroups",
				last.shims, report.MB(last.shimMem.RssAnon/int64(last.shims))))
	}
	for i, c := range last.many {
		t.Add("  "+c.ID, fmt.Sprintf("%.3f s", c.Restore.Seconds()), report.MB(last.manyMem[i]), fmt.Sprintf("first tick %d", c.FirstTick))
	}
	t.Print(os.Stdout)
}

func restoreTimes(cs []*ctrbench.Copy) []time.Duration {
	ds := make([]time.Duration, len(cs))
	for i, c := range cs {
		ds[i] = c.Restore
	}
	return ds
}

func loadavg() string {
	b, err := os.ReadFile("/proc/loadavg")
	if err != nil {
		return "?"
	}
	f := strings.Fields(string(b))
	if len(f) < 1 {
		return "?"
	}
	return f[0]
}
