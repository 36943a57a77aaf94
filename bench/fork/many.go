package main

import (
	"context"
	"fmt"
	"io"
	"os"
	"os/exec"
	"sort"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	containerd "github.com/containerd/containerd/v2/client"

	"github.com/lazyfork/lazyfork/bench/internal/report"
	lfclient "github.com/lazyfork/lazyfork/client"
	"github.com/lazyfork/lazyfork/integration/harness"
)

// runManyOnly measures only the batch: one parent of heapMiB, its snapshot
// kept, then rounds of n forks restored at once from it (each round removed
// before the next), with each fork's steps (client.WithStepTrace) summed up.
func runManyOnly(heapMiB, n, rounds int, debug bool) error {
	bin, cleanupBin, err := repoBinaries()
	if err != nil {
		return err
	}
	defer cleanupBin()
	ctx := context.Background()
	b, err := newBenchWith(bin, n, 0, harness.Options{Debug: debug})
	if err != nil {
		return err
	}
	defer b.close()
	ctx = b.h.Context(ctx)
	parent, err := b.startCounter(ctx, b.id(fmt.Sprintf("lf%d", heapMiB)), "io.containerd.lazyfork.v1", heapMiB)
	if parent != nil {
		defer b.remove(context.WithoutCancel(ctx), parent.Container)
	}
	if err != nil {
		return err
	}
	res, err := b.lf.Fork(ctx, parent.ID, 1, lfclient.KeepSnapshot(), b.logIO())
	if err != nil {
		return err
	}
	defer b.lf.RemoveSnapshot(context.WithoutCancel(ctx), res.Snapshot)
	b.remove(ctx, res.Forks[0].Container)
	if debug {
		fmt.Printf("containerd log: %s\n", b.h.LogPath)
	}
	var walls []time.Duration
	for r := 0; r < rounds; r++ {
		rec := newStepRecorder()
		stopPerf := startPerf(r)
		cpu0, busy0 := cgroupCPU(), machineBusy()
		t0 := time.Now()
		opts := append(rec.opts(), b.logIO())
		if p, _ := strconv.Atoi(os.Getenv("BENCH_PARALLEL")); p > 0 {
			opts = append(opts, lfclient.WithParallel(p))
		}
		forks, err := b.lf.RestoreForks(ctx, parent.ID, res.Snapshot, n, opts...)
		wall := time.Since(t0)
		cpu, busy := cgroupCPU()-cpu0, machineBusy()-busy0
		stopPerf()
		var ctrs []containerd.Container
		for _, f := range forks {
			ctrs = append(ctrs, f.Container)
		}
		if err != nil {
			b.removeAll(ctx, ctrs)
			return err
		}
		walls = append(walls, wall)
		var each []time.Duration
		var mems []float64
		for _, f := range forks {
			each = append(each, f.Restore)
			if mem, err := b.memory(ctx, f.Container); err == nil {
				mems = append(mems, float64(mem))
			}
		}
		fmt.Printf("round %d: %d forks in %.3f s wall; restore median %.3f s, max %.3f s; memory median %.2f MB, max %.2f MB; load %s\n",
			r+1, n, wall.Seconds(), report.Median(each).Seconds(), report.Max(each).Seconds(),
			report.Median(mems)/1e6, report.Max(mems)/1e6, loadavg())
		fmt.Printf("  cpu: this bench's cgroup %.2f s (%.1f ms per fork), the machine's %.2f s of %.2f s\n",
			cpu.Seconds(), cpu.Seconds()*1000/float64(n), busy.Seconds(), 2*wall.Seconds())
		rec.print(os.Stdout, t0)
		if r == rounds-1 {
			nShims, shims, _ := b.env.ShimMemory()
			fmt.Printf("shims: %d, PSS %.1f MB (%.2f MB per fork)\n", nShims, float64(shims.Pss)/1e6, float64(shims.Pss)/1e6/float64(n+1))
			printComposition(os.Stdout, b.forkMems(ctx, ctrs), b.h.Address)
		}
		t1 := time.Now()
		b.removeAll(ctx, ctrs)
		fmt.Printf("round %d: removed in %.3f s\n", r+1, time.Since(t1).Seconds())
	}
	sort.Slice(walls, func(i, j int) bool { return walls[i] < walls[j] })
	var ws []string
	for _, w := range walls {
		ws = append(ws, fmt.Sprintf("%.3f", w.Seconds()))
	}
	fmt.Printf("walls (s, sorted): %s\n", strings.Join(ws, " "))
	return nil
}

// removeAll removes containers in parallel.
func (b *bench) removeAll(ctx context.Context, ctrs []containerd.Container) {
	var wg sync.WaitGroup
	sem := make(chan struct{}, 8)
	for _, c := range ctrs {
		wg.Add(1)
		sem <- struct{}{}
		go func() {
			defer wg.Done()
			defer func() { <-sem }()
			b.remove(context.WithoutCancel(ctx), c)
		}()
	}
	wg.Wait()
}

func loadavg() string {
	b, err := os.ReadFile("/proc/loadavg")
	if err != nil {
		return "?"
	}
	f := strings.Fields(string(b))
	return strings.Join(f[:3], " ")
}

// stepRecorder collects the forks' steps.
type stepRecorder struct {
	mu    sync.Mutex
	steps map[string]map[lfclient.ForkStep]time.Time
	// begun is when each fork's call began, where the forks' calls differ
	// (print's t0 otherwise).
	begun map[string]time.Time
}

func newStepRecorder() *stepRecorder {
	return &stepRecorder{steps: map[string]map[lfclient.ForkStep]time.Time{}}
}

func (r *stepRecorder) opts() []lfclient.ForkOpt {
	return []lfclient.ForkOpt{lfclient.WithStepTrace(func(id string, s lfclient.ForkStep, at time.Time) {
		r.mu.Lock()
		defer r.mu.Unlock()
		if r.steps[id] == nil {
			r.steps[id] = map[lfclient.ForkStep]time.Time{}
		}
		r.steps[id][s] = at
	})}
}

var stepOrder = []lfclient.ForkStep{lfclient.StepQueued, lfclient.StepRootfs, lfclient.StepContainer,
	lfclient.StepCreate, lfclient.StepStart, lfclient.StepDone}

// print gives, per step, when the forks finished it (since t0, or since
// their call began: first, median, last) and how long it took them (from
// the step before: median, max, sum).
func (r *stepRecorder) print(w io.Writer, t0 time.Time) {
	if len(r.steps) == 0 {
		return
	}
	fmt.Fprintf(w, "  %-10s %8s %8s %8s | %8s %8s %8s\n", "step", "first", "median", "last", "d.med", "d.max", "d.sum")
	for i, s := range stepOrder {
		var at, d []time.Duration
		var sum time.Duration
		for id, m := range r.steps {
			t, ok := m[s]
			if !ok {
				continue
			}
			start := t0
			if b, ok := r.begun[id]; ok {
				start = b
			}
			at = append(at, t.Sub(start))
			prev := start
			if i > 0 {
				prev = m[stepOrder[i-1]]
			}
			d = append(d, t.Sub(prev))
			sum += t.Sub(prev)
		}
		if len(at) == 0 {
			continue
		}
		sort.Slice(at, func(i, j int) bool { return at[i] < at[j] })
		fmt.Fprintf(w, "  %-10s %8.3f %8.3f %8.3f | %8.3f %8.3f %8.2f\n", s, at[0].Seconds(), report.Median(at).Seconds(), at[len(at)-1].Seconds(),
			report.Median(d).Seconds(), report.Max(d).Seconds(), sum.Seconds())
	}
}

// cgroupCPU is the CPU time of this process's cpuacct cgroup (v1) and its
// descendants: containerd, the shims, runc and CRIU (run the bench in a
// cgroup of its own for it to mean that).
func cgroupCPU() time.Duration {
	b, err := os.ReadFile("/proc/self/cgroup")
	if err != nil {
		return 0
	}
	for _, l := range strings.Split(string(b), "\n") {
		f := strings.SplitN(l, ":", 3)
		if len(f) == 3 && strings.Contains(","+f[1]+",", ",cpuacct,") {
			v, err := os.ReadFile("/sys/fs/cgroup/cpuacct" + f[2] + "/cpuacct.usage")
			if err != nil {
				v, err = os.ReadFile("/sys/fs/cgroup/cpu,cpuacct" + f[2] + "/cpuacct.usage")
			}
			if err != nil {
				return 0
			}
			ns, _ := strconv.ParseInt(strings.TrimSpace(string(v)), 10, 64)
			return time.Duration(ns)
		}
	}
	return 0
}

// machineBusy is the machine's non-idle CPU time (/proc/stat).
func machineBusy() time.Duration {
	b, err := os.ReadFile("/proc/stat")
	if err != nil {
		return 0
	}
	f := strings.Fields(strings.SplitN(string(b), "\n", 2)[0])
	var busy int64
	for i, v := range f[1:] {
		x, _ := strconv.ParseInt(v, 10, 64)
		if i == 3 || i == 4 { // idle, iowait
			continue
		}
		busy += x
	}
	return time.Duration(busy) * 10 * time.Millisecond
}

// startPerf runs `perf record $BENCH_PERF_ARGS -o $BENCH_PERF.<round>` over
// a round when BENCH_PERF is set; the returned func stops it.
func startPerf(round int) func() {
	out := os.Getenv("BENCH_PERF")
	if out == "" {
		return func() {}
	}
	args := append([]string{"record", "-o", fmt.Sprintf("%s.%d", out, round+1)}, strings.Fields(os.Getenv("BENCH_PERF_ARGS"))...)
	cmd := exec.Command("perf", args...)
	cmd.Stderr = os.Stderr
	if err := cmd.Start(); err != nil {
		fmt.Fprintln(os.Stderr, "perf:", err)
		return func() {}
	}
	time.Sleep(500 * time.Millisecond) // perf's set-up
	return func() {
		_ = cmd.Process.Signal(syscall.SIGINT)
		_ = cmd.Wait()
	}
}
