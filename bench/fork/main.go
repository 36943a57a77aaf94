// Command fork is LazyFork's fork benchmark (make bench-fork): for a python
// container holding 64 MiB, 256 MiB and 1 GiB (integration/workloads/counter.py),
// LazyFork forks beside plain runc checkpoint/restore of the same workload, in
// one private containerd:
//
//   - the snapshot: pause -> dump -> rewrite -> resume (how long the parent is frozen);
//   - restore per fork, task create -> running, for 1 fork and for 10 at once;
//   - a fork of a fork: its snapshot (only the pages it wrote) and its restore;
//   - memory per fork (cgroup) right after restore and after 5 s of running and
//     writing a page a second, and the shim processes' memory divided by the forks;
//   - the floors: a fresh busybox task's start on runc.v2 and on lazyfork.v1, and
//     `runc run` of busybox's true;
//   - one fork's restore phase by phase (breakdown.go), from the logs.
//
// It prints a table, writes bench/results/fork.csv and draws bench/results/fork.png.
// Needs root, CRIU, containerd, runc (make deps, make images).
package main

import (
	"context"
	"flag"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"

	"github.com/lazyfork/lazyfork/bench/internal/ctrbench"
	lfclient "github.com/lazyfork/lazyfork/client"
	"github.com/lazyfork/lazyfork/integration/harness"
)

func main() {
	heaps := flag.String("heaps", "64,256,1024", "heap sizes in MiB")
	forks := flag.Int("forks", 10, "forks restored at once")
	plainMax := flag.Int("plain-many-max", 256, "largest heap (MiB) for which plain runc restores -forks copies at once (each costs the whole heap)")
	out := flag.String("out", "", "results directory (default: bench/results in the source tree)")
	only := flag.Bool("breakdown-only", false, "only the floors and one fork's phases (no heap series, nothing written)")
	many := flag.Bool("many-only", false, "only -forks forks at once of the first -heaps size, -rounds times, with each step's times (nothing written)")
	rounds := flag.Int("rounds", 3, "rounds of -many-only")
	debug := flag.Bool("debug", false, "containerd at debug level (its log is kept)")
	join := flag.Bool("shim-join", true, "a shim group's forks join the shim its first fork started, without a `shim start` each (client.WithShimJoin)")
	calls := flag.Bool("calls-only", false, "only -forks forks of the first -heaps size made one a call, each from a new snapshot of the running parent (nothing written)")
	group := flag.Int("shim-group", lfclient.DefaultShimGroupSize, "forks of a family per shim (client.WithShimGroupSize; 1: a shim each, as one-fork calls had before they shared)")
	flag.Parse()
	clientOpts = append(clientOpts, lfclient.WithShimJoin(*join), lfclient.WithShimGroupSize(*group))
	if *calls {
		h, err := strconv.Atoi(strings.Split(*heaps, ",")[0])
		if err == nil {
			err = runCallsOnly(h, *forks)
		}
		if err != nil {
			fmt.Fprintln(os.Stderr, "bench-fork:", err)
			os.Exit(1)
		}
		return
	}
	if *many {
		h, err := strconv.Atoi(strings.Split(*heaps, ",")[0])
		if err == nil {
			err = runManyOnly(h, *forks, *rounds, *debug)
		}
		if err != nil {
			fmt.Fprintln(os.Stderr, "bench-fork:", err)
			os.Exit(1)
		}
		return
	}
	if *only {
		if err := runBreakdownOnly(); err != nil {
			fmt.Fprintln(os.Stderr, "bench-fork:", err)
			os.Exit(1)
		}
		return
	}
	if err := run(*heaps, *forks, *plainMax, *out); err != nil {
		fmt.Fprintln(os.Stderr, "bench-fork:", err)
		os.Exit(1)
	}
}

// clientOpts are the LazyFork client's options (flags).
var clientOpts []lfclient.Opt

// floorRuns and breakdownForks are how many fresh starts per runtime (and
// runc runs) and how many traced forks the floors and the breakdown take.
const floorRuns, breakdownForks = 5, 5

// seqRestores is how many single forks each heap size restores one after
// another (restore_seq_median, restore_seq_max).
const seqRestores = 5

func run(heapList string, nForks, plainMax int, outDir string) error {
	if os.Geteuid() != 0 {
		return fmt.Errorf("needs root")
	}
	var heaps []int
	for _, h := range strings.Split(heapList, ",") {
		v, err := strconv.Atoi(strings.TrimSpace(h))
		if err != nil || v < 1 {
			return fmt.Errorf("bad heap size %q", h)
		}
		heaps = append(heaps, v)
	}
	repo, err := harness.RepoRoot()
	if err != nil {
		return err
	}
	if outDir == "" {
		outDir = filepath.Join(repo, "bench", "results")
	}
	bin, cleanupBin, err := binaries(repo)
	if err != nil {
		return err
	}
	defer cleanupBin()

	b, err := newBench(bin, nForks, plainMax)
	if err != nil {
		return err
	}
	defer b.close()
	ctx := context.Background()
	fmt.Fprintf(os.Stderr, "bench-fork: floors (fresh busybox on runc.v2 and lazyfork.v1, runc run)\n")
	fl, err := measureFloors(ctx, b.env, floorRuns)
	if err != nil {
		return fmt.Errorf("floors: %w", err)
	}
	b.m.addFloors(fl)
	for _, h := range heaps {
		fmt.Fprintf(os.Stderr, "bench-fork: heap %d MiB: LazyFork\n", h)
		if err := b.lazyfork(ctx, h); err != nil {
			return fmt.Errorf("lazyfork, %d MiB: %w", h, err)
		}
		fmt.Fprintf(os.Stderr, "bench-fork: heap %d MiB: plain runc\n", h)
		if err := b.plain(ctx, h); err != nil {
			return fmt.Errorf("plain, %d MiB: %w", h, err)
		}
	}
	fmt.Fprintf(os.Stderr, "bench-fork: breakdown of one fork (its own containerd, debug logs)\n")
	bd, err := runBreakdown(ctx, bin, breakdownForks)
	if err != nil {
		return fmt.Errorf("breakdown: %w", err)
	}
	b.m.addBreakdown(bd)
	t := b.m.table()
	t.Print(os.Stdout)
	csvPath := filepath.Join(outDir, "fork.csv")
	if err := t.WriteCSV(csvPath); err != nil {
		return err
	}
	pngPath := filepath.Join(outDir, "fork.png")
	if err := writePlot(pngPath, heaps, nForks, b.m); err != nil {
		return err
	}
	fmt.Printf("\nwrote %s and %s\n", csvPath, pngPath)
	bd.print(os.Stdout, fl)
	b.m.summary(os.Stdout, heaps, nForks)
	return nil
}

// runBreakdownOnly measures the floors and one fork's phases.
func runBreakdownOnly() error {
	bin, cleanupBin, err := repoBinaries()
	if err != nil {
		return err
	}
	defer cleanupBin()
	ctx := context.Background()
	env, _, err := ctrbench.SetupLazyFork(ctx, bin)
	if err != nil {
		return err
	}
	fl, err := measureFloors(ctx, env, floorRuns)
	env.Close()
	if err != nil {
		return fmt.Errorf("floors: %w", err)
	}
	bd, err := runBreakdown(ctx, bin, breakdownForks)
	if err != nil {
		return fmt.Errorf("breakdown: %w", err)
	}
	bd.print(os.Stdout, fl)
	return nil
}

// repoBinaries is binaries for this source tree.
func repoBinaries() (string, func(), error) {
	repo, err := harness.RepoRoot()
	if err != nil {
		return "", nil, err
	}
	return binaries(repo)
}

// binaries returns a directory with the shim (containerd-shim-lazyfork-v1 and
// containerd-shim-lazyfork-v1-full): $LAZYFORK_BIN
// (make bench-fork builds it) or a fresh build.
func binaries(repo string) (string, func(), error) {
	if d := os.Getenv("LAZYFORK_BIN"); d != "" {
		if _, err := os.Stat(filepath.Join(d, "containerd-shim-lazyfork-v1-full")); err == nil {
			return d, func() {}, nil
		}
	}
	dir, err := os.MkdirTemp("", "lf-bench-bin-")
	if err != nil {
		return "", nil, err
	}
	cmd := exec.Command("go", "build", "-o", dir+"/", "./cmd/containerd-shim-lazyfork-v1", "./cmd/containerd-shim-lazyfork-v1-full")
	cmd.Dir = repo
	if out, err := cmd.CombinedOutput(); err != nil {
		os.RemoveAll(dir)
		return "", nil, fmt.Errorf("build shim: %v\n%s", err, out)
	}
	return dir, func() { os.RemoveAll(dir) }, nil
}
