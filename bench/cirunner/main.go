// Command cirunner compares, per CI job, a cold build container (started for
// the job, warming up by itself) with a LazyFork fork of a warm one (snapshot
// taken once): time to first test output, time to the job's end, and the job
// container's memory. It prints a table and writes bench/results/cirunner.csv
// and cirunner.png.
//
//	cd bench && go run ./cirunner [-jobs 5] [-tests 50] [-size default|small] [-out results]
//
// Needs root, CRIU, containerd; builds the shim unless $LAZYFORK_BIN has it.
package main

import (
	"context"
	"flag"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"time"

	"golang.org/x/sys/unix"

	"github.com/lazyfork/lazyfork/bench/internal/plot"
	"github.com/lazyfork/lazyfork/bench/internal/report"
	lfclient "github.com/lazyfork/lazyfork/client"
	"github.com/lazyfork/lazyfork/examples/ci-runner/runner"
	"github.com/lazyfork/lazyfork/integration/harness"
)

func main() {
	jobs := flag.Int("jobs", 5, "jobs per mode")
	tests := flag.Int("tests", 50, "tests per job")
	size := flag.String("size", "default", "warm-up size: default or small")
	out := flag.String("out", "", "results directory (default: bench/results of the source tree)")
	flag.Parse()
	if err := run(*jobs, *tests, *size, *out); err != nil {
		fmt.Fprintln(os.Stderr, "cirunner:", err)
		os.Exit(1)
	}
}

func run(jobs, tests int, sizeName, out string) error {
	sz := runner.Default
	if sizeName == "small" {
		sz = runner.Small
	} else if sizeName != "default" {
		return fmt.Errorf("-size %q: want default or small", sizeName)
	}
	repo, err := harness.RepoRoot()
	if err != nil {
		return err
	}
	if out == "" {
		out = filepath.Join(repo, "bench", "results")
	}
	bin := os.Getenv("LAZYFORK_BIN")
	if _, err := os.Stat(filepath.Join(bin, "containerd-shim-lazyfork-v1-full")); bin == "" || err != nil {
		if bin, err = os.MkdirTemp("", "lf-cirunner-bin-"); err != nil {
			return err
		}
		defer os.RemoveAll(bin)
		cmd := exec.Command("go", "build", "-o", bin+"/", "./cmd/containerd-shim-lazyfork-v1", "./cmd/containerd-shim-lazyfork-v1-full")
		cmd.Dir = repo
		if b, err := cmd.CombinedOutput(); err != nil {
			return fmt.Errorf("build shim: %v\n%s", err, b)
		}
	}
	root, err := os.MkdirTemp("/tmp", "lfb-")
	if err != nil {
		return err
	}
	defer func() {
		_ = unix.Unmount(root, unix.MNT_DETACH)
		os.RemoveAll(root)
	}()
	ctx := context.Background()
	h, err := harness.Start(ctx, harness.Options{BinDirs: []string{bin}, Env: []string{"LAZYFORK_ROOT=" + root}})
	if err != nil {
		return err
	}
	defer h.Stop()
	ctx, cancel := context.WithTimeout(h.Context(ctx), 30*time.Minute)
	defer cancel()
	img, err := h.ImportImage(ctx, "python")
	if err != nil {
		return err
	}
	logs, err := h.TempDir("logs-")
	if err != nil {
		return err
	}
	r := &runner.Runner{Client: h.Client(), LazyFork: lfclient.New(h.Client(), lfclient.WithRoot(root)),
		Image: img, Size: sz, LogDir: logs, CgroupParent: h.CgroupParent}

	t := &report.Table{Title: fmt.Sprintf("CI jobs: cold container vs LazyFork fork (size %s: %d modules x %d funcs, %d rows; %d tests per job)",
		sizeName, sz.Modules, sz.Funcs, sz.Rows, tests),
		Columns: []string{"mode", "job", "first_output_s", "done_s", "memory_mb", "passed", "failed"}}
	var coldFirst, forkFirst, coldMem, forkMem []float64
	for i := 1; i <= jobs; i++ {
		res, err := r.RunCold(ctx, runner.Job{Name: fmt.Sprintf("c%d", i), Tests: tests})
		if err != nil {
			return err
		}
		t.Add("cold", res.Job.Name, res.FirstOutput, res.Total, float64(res.Memory)/1e6, res.Passed, res.Failed)
		coldFirst, coldMem = append(coldFirst, res.FirstOutput.Seconds()), append(coldMem, float64(res.Memory)/1e6)
	}
	w, err := r.StartWarm(ctx, "warm")
	if err != nil {
		return err
	}
	t.Add("warm-up", "-", w.WarmUp, w.WarmUp+w.Checkpoint, float64(w.Memory)/1e6, 0, 0)
	for i := 1; i <= jobs; i++ {
		res, err := r.RunForked(ctx, w, runner.Job{Name: fmt.Sprintf("f%d", i), Tests: tests})
		if err != nil {
			return err
		}
		t.Add("fork", res.Job.Name, res.FirstOutput, res.Total, float64(res.Memory)/1e6, res.Passed, res.Failed)
		forkFirst, forkMem = append(forkFirst, res.FirstOutput.Seconds()), append(forkMem, float64(res.Memory)/1e6)
	}
	t.Print(os.Stdout)
	fmt.Printf("\nwarm container: warm-up %.2f s, snapshot %.2f s, %.1f MB\n", w.WarmUp.Seconds(), w.Checkpoint.Seconds(), float64(w.Memory)/1e6)
	fmt.Printf("median time to first test output: cold %.3f s, fork %.3f s\n", report.Median(coldFirst), report.Median(forkFirst))
	fmt.Printf("median job memory: cold %.1f MB, fork %.1f MB\n", report.Median(coldMem), report.Median(forkMem))
	if err := os.MkdirAll(out, 0o755); err != nil {
		return err
	}
	csvPath, pngPath := filepath.Join(out, "cirunner.csv"), filepath.Join(out, "cirunner.png")
	if err := t.WriteCSV(csvPath); err != nil {
		return err
	}
	cats := []string{"cold container", "LazyFork fork"}
	medianSpread := func(cold, fork []float64) plot.Series {
		return plot.Series{Name: "median (bars: min..max)", Y: []float64{report.Median(cold), report.Median(fork)},
			Lo: []float64{report.Min(cold), report.Min(fork)}, Hi: []float64{report.Max(cold), report.Max(fork)}}
	}
	if err := plot.WritePNG(pngPath, fmt.Sprintf("CI job: cold container vs LazyFork fork (%d jobs each)", len(coldFirst)),
		plot.Panel{Title: "Time to first test output", YLabel: "s", Categories: cats, BarValues: true,
			Series: []plot.Series{medianSpread(coldFirst, forkFirst)}},
		plot.Panel{Title: "Memory of the job container", YLabel: "MB", Categories: cats, BarValues: true,
			Series: []plot.Series{medianSpread(coldMem, forkMem)}},
	); err != nil {
		return err
	}
	fmt.Printf("wrote %s and %s\n", csvPath, pngPath)
	return r.LazyFork.RemoveSnapshot(ctx, w.Snapshot)
}
