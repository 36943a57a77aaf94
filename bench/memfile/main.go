// Command memfile (make bench-memfile) measures LazyFork's memory-file restore
// against plain CRIU restore of the same dump, for heaps of 64 MiB to 2 GiB.
//
// For each heap it starts the C workload in quiet mode (each second it reads a few
// dozen random heap pages and writes one page), dumps it once, and then:
//   - copies the image: one copy is rewritten (memfile), the other restored as is;
//   - times a plain copy (cp) of the image's pages to the tmpfs, beside the rewrite;
//   - restores one copy five times (median), then ten at once, for both modes;
//   - reads each copy's RssAnon, Pss and RssShmem right after restore and after 5 s.
//
// It prints a table, writes bench/results/memfile.csv and draws
// bench/results/memfile.png (restore time and per-copy memory against heap size).
// Needs root and CRIU.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"golang.org/x/sys/unix"

	"github.com/lazyfork/lazyfork/bench/internal/report"
	"github.com/lazyfork/lazyfork/internal/criurun"
	"github.com/lazyfork/lazyfork/internal/criurun/memloop"
	"github.com/lazyfork/lazyfork/internal/procfs"
	"github.com/lazyfork/lazyfork/internal/workloads"
)

type config struct {
	heaps        []int
	copies       int
	singles      int
	settle       time.Duration
	activity     time.Duration
	plainMultiMB int
	out          string
	work         string
}

// row is one heap size in one mode.
type row struct {
	HeapMiB int
	Mode    string // "memfile" or "plain"

	Dump       time.Duration
	ImageBytes int64 // image directory after the dump (plain) or after the rewrite

	Rewrite      time.Duration
	RewriteBytes int64
	CopyTime     time.Duration // cp of the same pages to the same tmpfs
	CopyBytes    int64

	Restore1      time.Duration // median of singles
	Restore1CRIU  time.Duration // CRIU's own restore_time, median of singles
	PagesRestored uint64        // pages CRIU copied into a copy
	Restore10Wall time.Duration
	Restore10Mean time.Duration
	Restore10Max  time.Duration
	MemCopies     int // how many copies the memory columns average over

	After, After5s procfs.Mem // per copy, mean
	Note           string
}

func main() {
	c := &config{}
	var heaps string
	flag.StringVar(&heaps, "heaps", "64,256,1024,2048", "heap sizes, MiB")
	flag.IntVar(&c.copies, "copies", 10, "copies restored at once")
	flag.IntVar(&c.singles, "singles", 5, "single restores per mode (median reported)")
	flag.DurationVar(&c.settle, "settle", 2*time.Second, "run the workload this long before the dump")
	flag.DurationVar(&c.activity, "activity", 5*time.Second, "how long copies run before the second memory reading")
	flag.IntVar(&c.plainMultiMB, "plain-multi-max", 256, "largest heap (MiB) for which plain CRIU restores all copies at once (each copy holds the whole heap)")
	flag.StringVar(&c.out, "out", "results", "directory for memfile.csv and memfile.png")
	flag.StringVar(&c.work, "work", "", "work directory (images, tmpfs); default: a temporary directory")
	flag.Parse()
	for _, h := range strings.Split(heaps, ",") {
		n, err := strconv.Atoi(strings.TrimSpace(h))
		if err != nil || n < 16 {
			fmt.Fprintf(os.Stderr, "bad -heaps entry %q (MiB, at least 16)\n", h)
			os.Exit(2)
		}
		c.heaps = append(c.heaps, n)
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, unix.SIGTERM)
	defer stop()
	if err := run(ctx, c); err != nil {
		fmt.Fprintln(os.Stderr, "bench-memfile:", err)
		os.Exit(1)
	}
}

func run(ctx context.Context, c *config) error {
	if os.Geteuid() != 0 {
		return errors.New("needs root (CRIU)")
	}
	if err := criurun.BecomeSubreaper(); err != nil {
		return err
	}
	work := c.work
	if work == "" {
		var err error
		if work, err = os.MkdirTemp("", "bench-memfile-"); err != nil {
			return err
		}
		defer os.RemoveAll(work)
	}
	bin := filepath.Join(work, "bin")
	max := 0
	for _, h := range c.heaps {
		if h > max {
			max = h
		}
	}
	loop, err := memloop.Open(filepath.Join(work, "mem"), "bench", int64(max)<<20*2+(1<<30))
	if err != nil {
		return err
	}
	defer loop.Close()
	plain := &memloop.Loop{}

	var rows []row
	for _, heap := range c.heaps {
		fmt.Fprintf(os.Stderr, "== heap %d MiB\n", heap)
		m, p, err := oneHeap(ctx, c, loop, plain, bin, filepath.Join(work, fmt.Sprintf("h%d", heap)), heap)
		if err != nil {
			return fmt.Errorf("heap %d MiB: %w", heap, err)
		}
		rows = append(rows, m, p)
	}
	printTable(os.Stdout, rows)
	if err := writeCSV(filepath.Join(c.out, "memfile.csv"), rows); err != nil {
		return err
	}
	if err := writePlot(filepath.Join(c.out, "memfile.png"), rows); err != nil {
		return err
	}
	fmt.Printf("\nwrote %s and %s\n", filepath.Join(c.out, "memfile.csv"), filepath.Join(c.out, "memfile.png"))
	printTargets(os.Stdout, rows)
	return nil
}

func oneHeap(ctx context.Context, c *config, loop, plain *memloop.Loop, bin, dir string, heap int) (row, row, error) {
	mrow := row{HeapMiB: heap, Mode: "memfile"}
	prow := row{HeapMiB: heap, Mode: "plain"}
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return mrow, prow, err
	}
	defer os.RemoveAll(dir)
	cmd, err := workloads.CommandWith(ctx, workloads.C, bin, workloads.Options{HeapMiB: heap, TickMs: 1000, Quiet: true})
	if err != nil {
		return mrow, prow, err
	}
	out := workloads.Output(filepath.Join(dir, "parent.out"))
	w, err := criurun.Start(cmd, criurun.StartOptions{Stdout: string(out)})
	if err != nil {
		return mrow, prow, err
	}
	defer w.Kill()
	if err := out.WaitTicks(ctx, 1); err != nil {
		return mrow, prow, err
	}
	time.Sleep(c.settle)

	// One dump; two copies of it: one is rewritten, one restored plain.
	plainDir := filepath.Join(dir, "plain")
	d, err := criurun.Dump(ctx, w.PID, plainDir, criurun.DumpOptions{})
	if err != nil {
		return mrow, prow, err
	}
	w.Kill() // the copies do not need it, and it holds the whole heap
	prow.Dump, mrow.Dump = d.Duration, d.Duration
	prow.ImageBytes, _ = dirBytes(plainDir)
	memDir := filepath.Join(dir, "memfile")
	if err := copyDir(plainDir, memDir); err != nil {
		return mrow, prow, err
	}
	// Write back the copy, then read it once: the cp and the rewrite below both
	// read a warm image and neither pays for the other's writeback.
	unix.Sync()
	warm(memDir)

	// A plain copy of the same pages to the same tmpfs, then the rewrite.
	mrow.CopyBytes, mrow.CopyTime, err = timeCopy(memDir, filepath.Join(loop.MapDir, "..", ".bench-copy"))
	if err != nil {
		return mrow, prow, err
	}
	snap := &memloop.Snapshot{Dir: memDir}
	if snap.Rewrite, err = loop.Rewrite(ctx, memDir); err != nil {
		return mrow, prow, err
	}
	defer loop.Release(snap)
	mrow.Rewrite = snap.Rewrite.Duration
	mrow.RewriteBytes = int64(snap.Rewrite.PagesMoved) * 4096
	mrow.ImageBytes, _ = dirBytes(memDir)

	for _, x := range []struct {
		l   *memloop.Loop
		img string
		r   *row
	}{{loop, memDir, &mrow}, {plain, plainDir, &prow}} {
		fmt.Fprintf(os.Stderr, "   %s restores\n", x.r.Mode)
		if err := restores(ctx, c, x.l, x.img, filepath.Join(dir, x.r.Mode+"-out"), x.r); err != nil {
			return mrow, prow, err
		}
	}
	return mrow, prow, nil
}

func restores(ctx context.Context, c *config, l *memloop.Loop, img, outDir string, r *row) error {
	if err := os.MkdirAll(outDir, 0o755); err != nil {
		return err
	}
	var singles, criuTimes []time.Duration
	for i := 0; i < c.singles; i++ {
		cs, _, err := l.Restore(ctx, img, []string{filepath.Join(outDir, fmt.Sprintf("single%d.out", i))})
		if err != nil {
			return err
		}
		singles = append(singles, cs[0].Restore)
		criuTimes = append(criuTimes, cs[0].CRIUTime)
		r.PagesRestored = cs[0].PagesRestored
		if err := l.Kill(cs...); err != nil {
			return err
		}
	}
	r.Restore1, r.Restore1CRIU = report.Median(singles), report.Median(criuTimes)

	n := c.copies
	if r.Mode == "plain" && r.HeapMiB > c.plainMultiMB {
		n = 1
		r.Note = fmt.Sprintf("plain: %d copies at once would need %d MiB; memory measured on 1 copy", c.copies, c.copies*r.HeapMiB)
	}
	outs := make([]string, n)
	for i := range outs {
		outs[i] = filepath.Join(outDir, fmt.Sprintf("multi%d.out", i))
	}
	cs, wall, err := l.Restore(ctx, img, outs)
	if err != nil {
		return err
	}
	defer l.Kill(cs...)
	r.MemCopies = n
	if n == c.copies {
		r.Restore10Wall = wall
		var sum time.Duration
		for _, cp := range cs {
			sum += cp.Restore
			if cp.Restore > r.Restore10Max {
				r.Restore10Max = cp.Restore
			}
		}
		r.Restore10Mean = sum / time.Duration(n)
	}
	if r.After, err = meanMem(cs); err != nil {
		return err
	}
	select {
	case <-ctx.Done():
		return ctx.Err()
	case <-time.After(c.activity):
	}
	if r.After5s, err = meanMem(cs); err != nil {
		return err
	}
	// Every copy must still be ticking: a benchmark of dead copies means nothing.
	for _, cp := range cs {
		if _, last := workloads.Output(cp.Out).Ticks(); last == 0 {
			return fmt.Errorf("copy %d printed no tick after restore: %s", cp.PID, lastLine(cp.Out))
		}
	}
	return l.Kill(cs...)
}

func meanMem(cs []*memloop.Copy) (procfs.Mem, error) {
	var sum procfs.Mem
	for _, cp := range cs {
		m, err := procfs.TreeMem(cp.PID)
		if err != nil {
			return sum, fmt.Errorf("copy %d: %w", cp.PID, err)
		}
		sum = sum.Add(m)
	}
	n := int64(len(cs))
	return procfs.Mem{RssAnon: sum.RssAnon / n, RssFile: sum.RssFile / n, RssShmem: sum.RssShmem / n,
		Pss: sum.Pss / n, PssAnon: sum.PssAnon / n, PssShmem: sum.PssShmem / n}, nil
}

func lastLine(p string) string {
	ls := workloads.Output(p).Lines()
	if len(ls) == 0 {
		return "(no output)"
	}
	return ls[len(ls)-1]
}

// timeCopy copies the image's pages files to dst (on the store's tmpfs) with cp, the
// way anyone would copy them, and removes the copy.
func timeCopy(imageDir, dst string) (int64, time.Duration, error) {
	pages, _ := filepath.Glob(filepath.Join(imageDir, "pages-*.img"))
	if len(pages) == 0 {
		return 0, 0, fmt.Errorf("%s holds no pages-*.img", imageDir)
	}
	var n int64
	for _, p := range pages {
		if fi, err := os.Stat(p); err == nil {
			n += fi.Size()
		}
	}
	if err := os.MkdirAll(dst, 0o700); err != nil {
		return 0, 0, err
	}
	defer os.RemoveAll(dst)
	start := time.Now()
	if out, err := exec.Command("cp", append(pages, dst+"/")...).CombinedOutput(); err != nil {
		return 0, 0, fmt.Errorf("cp: %v: %s", err, out)
	}
	return n, time.Since(start), nil
}

func copyDir(src, dst string) error {
	if err := os.MkdirAll(dst, 0o700); err != nil {
		return err
	}
	ents, err := os.ReadDir(src)
	if err != nil {
		return err
	}
	for _, e := range ents {
		if !e.Type().IsRegular() {
			continue
		}
		in, err := os.Open(filepath.Join(src, e.Name()))
		if err != nil {
			return err
		}
		out, err := os.OpenFile(filepath.Join(dst, e.Name()), os.O_WRONLY|os.O_CREATE|os.O_EXCL, 0o600)
		if err == nil {
			_, err = io.Copy(out, in)
			err = errors.Join(err, out.Close())
		}
		in.Close()
		if err != nil {
			return err
		}
	}
	return nil
}

// warm reads the image once so the copy and the rewrite both read from page cache.
func warm(dir string) {
	pages, _ := filepath.Glob(filepath.Join(dir, "pages-*.img"))
	buf := make([]byte, 1<<20)
	for _, p := range pages {
		if f, err := os.Open(p); err == nil {
			for {
				if _, err := f.Read(buf); err != nil {
					break
				}
			}
			f.Close()
		}
	}
}

func dirBytes(dir string) (int64, error) {
	var n int64
	ents, err := os.ReadDir(dir)
	for _, e := range ents {
		if fi, err := e.Info(); err == nil && fi.Mode().IsRegular() {
			n += fi.Size()
		}
	}
	return n, err
}

func ms(d time.Duration) string {
	if d == 0 {
		return "-"
	}
	return fmt.Sprintf("%.1f", float64(d.Microseconds())/1000)
}

func mibs(b int64) string { return fmt.Sprintf("%.2f", float64(b)/(1<<20)) }

func gibps(b int64, d time.Duration) float64 {
	if d <= 0 {
		return 0
	}
	return float64(b) / d.Seconds() / (1 << 30)
}

func printTable(w io.Writer, rows []row) {
	t := &report.Table{Columns: []string{"heap MiB", "mode", "dump ms", "image MiB", "rewrite GiB/s", "cp GiB/s", "ratio",
		"restore 1 ms", "criu's own", "pages", "N at once: wall ms", "mean ms", "copies", "RssAnon MiB", "Pss MiB",
		"RssShmem MiB", "RssAnon 5s", "Pss 5s", "RssShmem 5s"}}
	for _, r := range rows {
		rw, cp, ratio := "-", "-", "-"
		if r.Mode == "memfile" {
			a, b := gibps(r.RewriteBytes, r.Rewrite), gibps(r.CopyBytes, r.CopyTime)
			rw, cp = fmt.Sprintf("%.2f", a), fmt.Sprintf("%.2f", b)
			if b > 0 {
				ratio = fmt.Sprintf("%.2f", a/b)
			}
		}
		t.Add(r.HeapMiB, r.Mode, ms(r.Dump), mibs(r.ImageBytes), rw, cp, ratio, ms(r.Restore1), ms(r.Restore1CRIU),
			r.PagesRestored, ms(r.Restore10Wall), ms(r.Restore10Mean), r.MemCopies,
			mibs(r.After.RssAnon), mibs(r.After.Pss), mibs(r.After.RssShmem),
			mibs(r.After5s.RssAnon), mibs(r.After5s.Pss), mibs(r.After5s.RssShmem))
	}
	t.Print(w)
	for _, r := range rows {
		if r.Note != "" {
			fmt.Fprintf(w, "note (%d MiB): %s\n", r.HeapMiB, r.Note)
		}
	}
}

func writeCSV(path string, rows []row) error {
	t := &report.Table{Columns: []string{"heap_mib", "mode", "dump_ms", "image_bytes", "rewrite_ms", "rewrite_bytes", "rewrite_gibps",
		"copy_ms", "copy_bytes", "copy_gibps", "rewrite_vs_copy", "restore1_ms", "restore1_criu_ms", "pages_restored", "restore10_wall_ms", "restore10_mean_ms",
		"restore10_max_ms", "mem_copies", "rss_anon_kb", "pss_kb", "rss_shmem_kb", "rss_anon_5s_kb", "pss_5s_kb", "rss_shmem_5s_kb", "note"}}
	f64 := func(d time.Duration) string { return strconv.FormatFloat(float64(d.Microseconds())/1000, 'f', 2, 64) }
	kb := func(b int64) string { return strconv.FormatInt(b>>10, 10) }
	for _, r := range rows {
		ratio := ""
		a, b := gibps(r.RewriteBytes, r.Rewrite), gibps(r.CopyBytes, r.CopyTime)
		if a > 0 && b > 0 {
			ratio = strconv.FormatFloat(a/b, 'f', 3, 64)
		}
		t.Rows = append(t.Rows, []string{strconv.Itoa(r.HeapMiB), r.Mode, f64(r.Dump), strconv.FormatInt(r.ImageBytes, 10),
			f64(r.Rewrite), strconv.FormatInt(r.RewriteBytes, 10), strconv.FormatFloat(a, 'f', 3, 64),
			f64(r.CopyTime), strconv.FormatInt(r.CopyBytes, 10), strconv.FormatFloat(b, 'f', 3, 64), ratio,
			f64(r.Restore1), f64(r.Restore1CRIU), strconv.FormatUint(r.PagesRestored, 10), f64(r.Restore10Wall), f64(r.Restore10Mean), f64(r.Restore10Max), strconv.Itoa(r.MemCopies),
			kb(r.After.RssAnon), kb(r.After.Pss), kb(r.After.RssShmem), kb(r.After5s.RssAnon), kb(r.After5s.Pss),
			kb(r.After5s.RssShmem), r.Note})
	}
	return t.WriteCSV(path)
}

// printTargets compares the run with the targets of the memfile issue.
func printTargets(w io.Writer, rows []row) {
	get := func(heap int, mode string) *row {
		for i := range rows {
			if rows[i].HeapMiB == heap && rows[i].Mode == mode {
				return &rows[i]
			}
		}
		return nil
	}
	verdict := func(ok bool) string {
		if ok {
			return "MET"
		}
		return "MISSED"
	}
	fmt.Fprintln(w, "\ntargets:")
	if a, b := get(64, "memfile"), get(2048, "memfile"); a != nil && b != nil {
		x := float64(b.Restore1) / float64(a.Restore1)
		fmt.Fprintf(w, "  restore per copy flat: 2 GiB %s ms vs 64 MiB %s ms = %.2fx (want <= 1.3x): %s\n", ms(b.Restore1), ms(a.Restore1), x, verdict(x <= 1.3))
	}
	if m, p := get(1024, "memfile"), get(1024, "plain"); m != nil && p != nil {
		x := float64(p.Restore1) / float64(m.Restore1)
		fmt.Fprintf(w, "  1 GiB: plain %s ms / memfile %s ms = %.1fx faster (want >= 10x): %s\n", ms(p.Restore1), ms(m.Restore1), x, verdict(x >= 10))
	}
	worst := int64(0)
	for _, r := range rows {
		if r.Mode == "memfile" && r.After.RssAnon > worst {
			worst = r.After.RssAnon
		}
	}
	fmt.Fprintf(w, "  RssAnon per copy right after restore, worst heap: %d kB (want < 1 MB = 1000 kB): %s\n", worst>>10, verdict(worst < 1000*1000))
	for _, r := range rows {
		if r.Mode == "memfile" {
			a, b := gibps(r.RewriteBytes, r.Rewrite), gibps(r.CopyBytes, r.CopyTime)
			if b > 0 {
				fmt.Fprintf(w, "  rewrite %d MiB: %.2f GiB/s vs cp %.2f GiB/s = %.2fx (want >= 0.8x): %s\n", r.HeapMiB, a, b, a/b, verdict(a/b >= 0.8))
			}
		}
	}
}
