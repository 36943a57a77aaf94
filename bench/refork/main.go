// Command refork is LazyFork's repeated-fork benchmark (make bench-refork): a
// running parent forked ten times in succession, one fork per call, writing
// about 1 MB between calls, as agents and tree searches fork (issue 11).
//
// For parents holding 64 MiB, 256 MiB and 1 GiB, in one private containerd, it
// runs the same calls for a parent that moves onto its snapshot's memory file at
// each checkpoint (the default) and for a parent that opts out (annotation
// lazyfork.io/rehome=false, mode "off": it keeps its private heap and every
// snapshot dumps it whole). A moving parent runs twice: writing pages spread
// over its heap (mode "move", the worst case: every page written is an island
// its next move maps from the new file, so its mappings grow with each call)
// and writing one run of consecutive pages (mode "move-run"). Per call it records the parent's pause
// (Result.Paused), the wall time of the call, the bytes the call added to the
// memory-file tmpfs (LAZYFORK_ROOT/mem without .views, st_blocks*512), the
// snapshot image size, and the parent's memory after the call (cgroup, and the
// RssAnon of its process). A plain runc checkpoint of an identical container
// (runtime io.containerd.runc.v2, leave running) is the yardstick of the first
// snapshot. For the -total-heaps sizes it then forks 100 at once from the
// parent and sums what parent + forks cost: their cgroups, the family's tmpfs
// bytes and the shims' PSS.
//
// It prints the tables, writes bench/results/refork.csv (one row per call),
// refork-totals.csv, and draws bench/results/refork.png.
// Needs root, CRIU, containerd, runc (make deps, make images).
package main

import (
	"context"
	"flag"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"

	"github.com/lazyfork/lazyfork/integration/harness"
)

func main() {
	heaps := flag.String("heaps", "64,256,1024", "parent heap sizes in MiB")
	calls := flag.Int("calls", 10, "successive fork calls per parent")
	writeKiB := flag.Int("write-kib", 1024, "KiB the parent writes between calls (whole 4 KiB pages)")
	totalHeaps := flag.String("total-heaps", "256", "heap sizes (MiB) for which parent + -total-forks forks are summed; \"\" for none")
	totalForks := flag.Int("total-forks", 100, "forks made at once for the totals")
	plainRuns := flag.Int("plain-runs", 3, "plain runc checkpoints per heap size (median reported)")
	firstRuns := flag.Int("first-runs", 3, "first snapshots of fresh parents per heap size, alternating with the plain checkpoints (besides each series' call 1)")
	keepForks := flag.Bool("keep-forks", false, "keep each call's fork running until the parent's configuration ends (off-mode forks each hold a whole heap file)")
	modeList := flag.String("modes", strings.Join(modes, ","), "series to run per heap size")
	out := flag.String("out", "", "results directory (default: bench/results in the source tree)")
	var stackEnv []string
	flag.Func("stack-env", "KEY=VALUE for the stack's containerd and shims (repeatable), e.g. LAZYFORK_REHOME_BATCH=off", func(kv string) error {
		if k, _, ok := strings.Cut(kv, "="); !ok || !strings.HasPrefix(k, "LAZYFORK_") {
			return fmt.Errorf("want LAZYFORK_NAME=VALUE, not %q", kv)
		}
		stackEnv = append(stackEnv, kv)
		return nil
	})
	breakdown := flag.Bool("breakdown", false, "print each call's phases (the shim's move and checkpoint fields) and its fork's memory (VMAs, smaps_rollup, page tables, cgroup memory.stat, kmem and its largest slabs), and the parent's")
	flag.Parse()
	if err := selectModes(*modeList); err != nil {
		fmt.Fprintln(os.Stderr, "bench-refork:", err)
		os.Exit(2)
	}
	cfg := config{calls: *calls, writePages: *writeKiB / 4, totalForks: *totalForks, plainRuns: *plainRuns, firstRuns: *firstRuns, keepForks: *keepForks, breakdown: *breakdown, stackEnv: stackEnv}
	var err error
	if cfg.heaps, err = sizes(*heaps); err == nil {
		cfg.totalHeaps, err = sizes(*totalHeaps)
	}
	if err == nil {
		err = run(cfg, *out)
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "bench-refork:", err)
		os.Exit(1)
	}
}

type config struct {
	heaps, totalHeaps []int
	calls             int
	writePages        int
	totalForks        int
	plainRuns         int
	firstRuns         int
	keepForks         bool
	breakdown         bool
	stackEnv          []string // the stack's environment (-stack-env)
}

// selectModes narrows modes to the comma-separated list, keeping their order.
func selectModes(list string) error {
	var keep []string
	for _, m := range strings.Split(list, ",") {
		m = strings.TrimSpace(m)
		if m == "" {
			continue
		}
		if !slices.Contains(modes, m) {
			return fmt.Errorf("unknown mode %q (modes: %s)", m, strings.Join(modes, ", "))
		}
		keep = append(keep, m)
	}
	if len(keep) == 0 {
		return fmt.Errorf("-modes names no mode")
	}
	modes = keep
	return nil
}

func sizes(list string) ([]int, error) {
	var out []int
	for _, h := range strings.Split(list, ",") {
		if strings.TrimSpace(h) == "" {
			continue
		}
		v, err := strconv.Atoi(strings.TrimSpace(h))
		if err != nil || v < 1 {
			return nil, fmt.Errorf("bad heap size %q", h)
		}
		out = append(out, v)
	}
	return out, nil
}

func run(cfg config, outDir string) error {
	if os.Geteuid() != 0 {
		return fmt.Errorf("needs root")
	}
	if cfg.calls < 2 || cfg.writePages < 1 {
		return fmt.Errorf("need -calls >= 2 and -write-kib >= 4")
	}
	repo, err := harness.RepoRoot()
	if err != nil {
		return err
	}
	if outDir == "" {
		outDir = filepath.Join(repo, "bench", "results")
	}
	bin := os.Getenv("LAZYFORK_BIN")
	if bin == "" {
		bin = filepath.Join(repo, "bin")
	}
	if _, err := os.Stat(filepath.Join(bin, "containerd-shim-lazyfork-v1-full")); err != nil {
		return fmt.Errorf("no shim in %s (make build, or set LAZYFORK_BIN): %w", bin, err)
	}
	b, err := newBench(bin, cfg)
	if err != nil {
		return err
	}
	defer b.close()
	ctx := context.Background()
	load0 := loadavg()
	for _, h := range cfg.heaps {
		fmt.Fprintf(os.Stderr, "bench-refork: heap %d MiB: plain runc checkpoints, first snapshots of fresh parents\n", h)
		if err := b.plain(ctx, h); err != nil {
			return fmt.Errorf("plain, %d MiB: %w", h, err)
		}
		for _, mode := range modes {
			fmt.Fprintf(os.Stderr, "bench-refork: heap %d MiB: %d calls, mode %s\n", h, cfg.calls, mode)
			if err := b.series(ctx, h, mode); err != nil {
				return fmt.Errorf("%s, %d MiB: %w", mode, h, err)
			}
		}
	}
	r := b.r
	fmt.Println()
	r.summaryTable().Print(os.Stdout)
	fmt.Println()
	r.totalsTable().Print(os.Stdout)
	csvPath := filepath.Join(outDir, "refork.csv")
	if err := r.callsTable().WriteCSV(csvPath); err != nil {
		return err
	}
	totPath := filepath.Join(outDir, "refork-totals.csv")
	if err := r.totalsTable().WriteCSV(totPath); err != nil {
		return err
	}
	pngPath := filepath.Join(outDir, "refork.png")
	if err := writePlot(pngPath, cfg, r); err != nil {
		return err
	}
	fmt.Printf("\nwrote %s, %s and %s\n", csvPath, totPath, pngPath)
	r.targets(os.Stdout, cfg)
	fmt.Printf("\nload average (1, 5, 15 min; 2 CPUs, other work may share them): at start %s, at end %s\n", load0, loadavg())
	return nil
}

// loadavg is the first three fields of /proc/loadavg: the figures above are
// wall-clock times and a busy host stretches them.
func loadavg() string {
	b, err := os.ReadFile("/proc/loadavg")
	if err != nil {
		return "?"
	}
	f := strings.Fields(string(b))
	if len(f) < 3 {
		return "?"
	}
	return strings.Join(f[:3], " ")
}
