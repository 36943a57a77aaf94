// Command allocators measures allocators in memory-file forks: for glibc,
// jemalloc (defaults and decay 0) and mimalloc, each dumped, rewritten into
// memory files and restored as forks, with the madvise guard off
// (unguarded), refusing purges (refuse) and zeroing them through a ptrace
// supervisor (zero). Per allocator and mode it reports the integrity
// failures the forks saw, their throughput, and each fork's memory after
// the watch beside its parent's; then the cost of one madvise call in each
// mode, measured by a probe. It prints tables and writes
// bench/results/allocators.csv, bench/results/allocators-madvise.csv and
// bench/results/allocators.png.
//
// Run as root: `make bench-allocators`
// (flags: -watch, -forks, -mib, -threads, -out).
package main

import (
	"bufio"
	"context"
	"flag"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"time"

	"golang.org/x/sys/unix"

	"github.com/lazyfork/lazyfork/allocators"
	"github.com/lazyfork/lazyfork/bench/internal/report"
	"github.com/lazyfork/lazyfork/integration/harness"
	"github.com/lazyfork/lazyfork/internal/criurun"
	"github.com/lazyfork/lazyfork/internal/procfs"
	"github.com/lazyfork/lazyfork/memfile"
	"github.com/lazyfork/lazyfork/memfile/madvguard"
)

// row is one process of one (allocator, mode) family.
type row struct {
	Alloc, Mode, Role string
	Seconds           float64
	Ops, Callocs      uint64
	BadCalloc, BadPat uint64
	Mem               procfs.Mem
	Zeroed, Refused   uint64
	UsPerStop         float64
}

// cost is the mean time of one madvise(MADV_DONTNEED) on a 4 KiB page.
type cost struct {
	Where   string // "original", "fork"
	Mode    string
	Range   string // "inside" the guarded memory or "outside" it
	Result  string // what the call returned
	NsPerOp float64
}

var modes = []string{"unguarded", "refuse", "zero"}

func main() {
	madvguard.MaybeServe() // supervisors are re-executions of this program
	watch := flag.Duration("watch", 60*time.Second, "how long forks churn before they are measured")
	forks := flag.Int("forks", 2, "forks per allocator and mode")
	mib := flag.Int("mib", 64, "working set of the churn program")
	threads := flag.Int("threads", 2, "churn threads")
	out := flag.String("out", "results", "directory for the CSVs and the plot")
	keep := flag.Bool("keep", false, "keep the work directory")
	costsOnly := flag.Bool("costs-only", false, "only measure the madvise cost per call")
	flag.Parse()
	if os.Geteuid() != 0 {
		fatal(fmt.Errorf("run as root (CRIU)"))
	}
	if err := criurun.BecomeSubreaper(); err != nil {
		fatal(err)
	}
	ctx := context.Background()
	work, err := os.MkdirTemp("", "bench-allocators-")
	if err != nil {
		fatal(err)
	}
	memRoot := filepath.Join(work, "mem")
	if err := memfile.EnsureTmpfs(memRoot, 16<<30); err != nil {
		fatal(err)
	}
	defer func() {
		unix.Unmount(memRoot, unix.MNT_DETACH)
		if !*keep {
			os.RemoveAll(work)
		}
	}()
	store, err := memfile.OpenStore(memRoot)
	if err != nil {
		fatal(err)
	}
	bins, err := allocators.Build(ctx, filepath.Join(work, "bin"))
	if err != nil {
		fatal(err)
	}

	var rows []row
	for _, cfg := range allocators.Configs {
		if *costsOnly {
			break
		}
		fmt.Fprintf(os.Stderr, "%s: %d forks per mode, %v of churn...\n", cfg.Name, *forks, *watch)
		rs, err := runConfig(ctx, store, bins, cfg, work, *forks, *watch, *mib, *threads)
		if err != nil {
			fatal(fmt.Errorf("%s: %w", cfg.Name, err))
		}
		rows = append(rows, rs...)
	}
	fmt.Fprintln(os.Stderr, "madvise cost per call...")
	costs, err := measureCosts(ctx, store, work)
	if err != nil {
		fatal(fmt.Errorf("madvise cost: %w", err))
	}

	printRows(os.Stdout, rows, *watch)
	fmt.Println()
	printCosts(os.Stdout, costs)
	if err := writeRows(filepath.Join(*out, "allocators.csv"), rows); err != nil {
		fatal(err)
	}
	if err := writeCosts(filepath.Join(*out, "allocators-madvise.csv"), costs); err != nil {
		fatal(err)
	}
	if err := writePlot(filepath.Join(*out, "allocators.png"), rows); err != nil {
		fatal(err)
	}
	fmt.Printf("\nwrote %s, %s and %s\n", filepath.Join(*out, "allocators.csv"),
		filepath.Join(*out, "allocators-madvise.csv"), filepath.Join(*out, "allocators.png"))
}

func fatal(err error) {
	fmt.Fprintln(os.Stderr, "bench/allocators:", err)
	os.Exit(1)
}

// runConfig runs the three modes of one allocator at once.
func runConfig(ctx context.Context, store *memfile.Store, bins map[string]string, cfg allocators.Config,
	work string, forks int, watch time.Duration, mib, threads int) ([]row, error) {
	var opts []allocators.RunOptions
	var mu sync.Mutex
	mems := map[string]map[string]procfs.Mem{}
	for _, m := range modes {
		var mode *madvguard.Mode
		if m != "unguarded" {
			md, _ := madvguard.ParseMode(m)
			mode = &md
		}
		family := fmt.Sprintf("bench-%d-%s-%s", os.Getpid(), cfg.Name, m)
		prep, err := allocators.MemfilePrepare(store, family, mode)
		if err != nil {
			return nil, err
		}
		mems[m] = map[string]procfs.Mem{}
		opts = append(opts, allocators.RunOptions{
			Config: cfg, Bins: bins, Dir: filepath.Join(work, cfg.Name+"-"+m), Prepare: prep,
			Forks: forks, Warmup: 3 * time.Second, Watch: watch, Threads: threads, MiB: mib,
			Supervise: m == "zero",
			Sample: func(role string, pid int) {
				mem, _ := procfs.ReadMem(pid)
				mu.Lock()
				mems[m][role] = mem
				mu.Unlock()
			},
		})
	}
	results, errs := allocators.RunAll(ctx, opts)
	var rows []row
	for i, m := range modes {
		if errs[i] != nil {
			return nil, fmt.Errorf("%s: %w", m, errs[i])
		}
		for _, c := range results[i].Copies {
			r := row{Alloc: cfg.Name, Mode: m, Role: c.Role, Seconds: float64(c.Last.T - c.First.T),
				Ops: c.Last.Ops - c.First.Ops, Callocs: c.Last.Callocs - c.First.Callocs,
				BadCalloc: c.Last.BadCalloc, BadPat: c.Last.BadPattern, Mem: mems[m][c.Role]}
			if c.Sup != nil {
				r.Zeroed, r.Refused = c.Sup.Zeroed, c.Sup.Refused
				if c.Sup.Zeroed > 0 {
					r.UsPerStop = float64(c.Sup.Busy.Microseconds()) / float64(c.Sup.Zeroed)
				}
			}
			rows = append(rows, r)
		}
	}
	return rows, nil
}

func mb(n int64) float64 { return float64(n) / (1 << 20) }

func printRows(w io.Writer, rows []row, watch time.Duration) {
	t := &report.Table{Title: fmt.Sprintf("Allocators in memory-file forks: %v of churn, memory at the end (MiB)", watch),
		Columns: []string{"allocator", "mode", "process", "ops/s", "callocs", "bad calloc", "bad pattern", "RssAnon", "Pss", "RssShmem", "zeroed", "us/zero"}}
	for _, r := range rows {
		ops := 0.0
		if r.Seconds > 0 {
			ops = float64(r.Ops) / r.Seconds
		}
		t.Add(r.Alloc, r.Mode, r.Role, fmt.Sprintf("%.0f", ops), r.Callocs, r.BadCalloc, r.BadPat,
			fmt.Sprintf("%.1f", mb(r.Mem.RssAnon)), fmt.Sprintf("%.1f", mb(r.Mem.Pss)), fmt.Sprintf("%.1f", mb(r.Mem.RssShmem)),
			r.Zeroed, fmt.Sprintf("%.1f", r.UsPerStop))
	}
	t.Print(w)
}

func writeRows(path string, rows []row) error {
	t := &report.Table{Columns: []string{"allocator", "mode", "process", "seconds", "ops", "callocs", "bad_calloc", "bad_pattern",
		"rss_anon_bytes", "pss_bytes", "rss_shmem_bytes", "zeroed", "refused", "us_per_zero"}}
	for _, r := range rows {
		t.Rows = append(t.Rows, []string{r.Alloc, r.Mode, r.Role, fmt.Sprint(r.Seconds), fmt.Sprint(r.Ops), fmt.Sprint(r.Callocs),
			fmt.Sprint(r.BadCalloc), fmt.Sprint(r.BadPat), fmt.Sprint(r.Mem.RssAnon), fmt.Sprint(r.Mem.Pss),
			fmt.Sprint(r.Mem.RssShmem), fmt.Sprint(r.Zeroed), fmt.Sprint(r.Refused), fmt.Sprintf("%.2f", r.UsPerStop)})
	}
	return t.WriteCSV(path)
}

// measureCosts times madvise(MADV_DONTNEED) in the probe: in its original,
// and in forks rewritten into memory files in each mode (zero with and
// without its supervisor).
func measureCosts(ctx context.Context, store *memfile.Store, work string) ([]cost, error) {
	dir := filepath.Join(work, "probe")
	os.MkdirAll(dir, 0o755)
	bin := filepath.Join(dir, "probe")
	repo, err := harness.RepoRoot()
	if err != nil {
		return nil, err
	}
	probe := filepath.Join(repo, "memfile", "madvguard", "testdata", "probe.c")
	if out, err := exec.CommandContext(ctx, "gcc", "-O2", "-Wall", "-pthread", "-o", bin, probe).CombinedOutput(); err != nil {
		return nil, fmt.Errorf("gcc %s: %w: %s", probe, err, out)
	}
	pout := filepath.Join(dir, "parent.out")
	w, err := criurun.Start([]string{bin}, criurun.StartOptions{Stdout: pout, Dir: dir})
	if err != nil {
		return nil, err
	}
	defer w.Kill()
	time.Sleep(2 * time.Second)
	var costs []cost
	in, inRes, out, _ := probeCost(pout, 10)
	costs = append(costs, cost{"original", "-", "inside", inRes, in}, cost{"original", "-", "outside", "ok", out})

	for _, m := range modes {
		var mode *madvguard.Mode
		if m != "unguarded" {
			md, _ := madvguard.ParseMode(m)
			mode = &md
		}
		prep, err := allocators.MemfilePrepare(store, fmt.Sprintf("probe-%d-%s", os.Getpid(), m), mode)
		if err != nil {
			return nil, err
		}
		img := filepath.Join(dir, "img-"+m)
		if _, err := criurun.Dump(ctx, w.PID, img, criurun.DumpOptions{}); err != nil {
			return nil, err
		}
		if err := prep(ctx, img, 1); err != nil {
			return nil, err
		}
		cout := filepath.Join(dir, "fork-"+m+".out")
		r, err := criurun.Restore(ctx, img, criurun.RestoreOptions{Stdout: cout})
		if err != nil {
			return nil, err
		}
		time.Sleep(2 * time.Second)
		in, inRes, out, _ := probeCost(cout, 10)
		name := m
		if m == "zero" {
			name = "zero, no supervisor"
		}
		costs = append(costs, cost{"fork", name, "inside", inRes, in}, cost{"fork", name, "outside", "ok", out})
		if m == "zero" {
			sup, err := madvguard.SpawnSupervisor(r.PID)
			if err != nil {
				criurun.Kill(r.PID)
				return nil, err
			}
			skip := countLines(cout)
			time.Sleep(2 * time.Second)
			in, inRes, out, _ := probeCostAfter(cout, skip, 10)
			costs = append(costs, cost{"fork", "zero, supervised", "inside", inRes, in}, cost{"fork", "zero, supervised", "outside", "ok", out})
			sup.Close()
		}
		criurun.Kill(r.PID)
	}
	return costs, nil
}

func countLines(path string) int {
	b, _ := os.ReadFile(path)
	return strings.Count(string(b), "\n")
}

func probeCost(path string, n int) (float64, string, float64, error) {
	return probeCostAfter(path, 0, n)
}

// probeCostAfter returns the median in_ns and out_ns of the last n probe
// lines after the first skip lines, and what the inside call returned.
func probeCostAfter(path string, skip, n int) (float64, string, float64, error) {
	f, err := os.Open(path)
	if err != nil {
		return 0, "", 0, err
	}
	defer f.Close()
	var ins, outs []float64
	res := ""
	sc := bufio.NewScanner(f)
	for i := 0; sc.Scan(); i++ {
		if i < skip || !strings.HasPrefix(sc.Text(), "probe in=") {
			continue
		}
		kv := map[string]string{}
		for _, f := range strings.Fields(sc.Text())[1:] {
			k, v, _ := strings.Cut(f, "=")
			kv[k] = v
		}
		a, err1 := strconv.ParseFloat(kv["in_ns"], 64)
		b, err2 := strconv.ParseFloat(kv["out_ns"], 64)
		if err1 == nil && err2 == nil {
			ins, outs, res = append(ins, a), append(outs, b), kv["in"]
		}
	}
	if len(ins) > n {
		ins, outs = ins[len(ins)-n:], outs[len(outs)-n:]
	}
	return report.Median(ins), res, report.Median(outs), nil
}

func printCosts(w io.Writer, cs []cost) {
	t := &report.Table{Title: "madvise(MADV_DONTNEED) of one written 4 KiB page, median of 10 x 100 calls",
		Columns: []string{"process", "mode", "range", "returns", "ns/call"}}
	for _, c := range cs {
		t.Add(c.Where, c.Mode, c.Range, c.Result, fmt.Sprintf("%.0f", c.NsPerOp))
	}
	t.Print(w)
}

func writeCosts(path string, cs []cost) error {
	t := &report.Table{Columns: []string{"process", "mode", "range", "returns", "ns_per_call"}}
	for _, c := range cs {
		t.Rows = append(t.Rows, []string{c.Where, c.Mode, c.Range, c.Result, fmt.Sprintf("%.0f", c.NsPerOp)})
	}
	return t.WriteCSV(path)
}
