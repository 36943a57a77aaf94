package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/lazyfork/lazyfork/internal/criurun"
	"github.com/lazyfork/lazyfork/internal/criurun/memloop"
	"github.com/lazyfork/lazyfork/internal/procfs"
	"github.com/lazyfork/lazyfork/internal/workloads"
)

type genRow struct {
	gen  int
	snap *memloop.Snapshot
	wall time.Duration
}

type copyRow struct {
	gen   int
	idx   int
	copy  *memloop.Copy
	mem   procfs.Mem
	check string
}

func run(ctx context.Context, c *config, w io.Writer) (err error) {
	if os.Geteuid() != 0 {
		return errors.New("CRIU needs root: run as root")
	}
	if err := criurun.BecomeSubreaper(); err != nil {
		return fmt.Errorf("become subreaper: %w", err)
	}
	work := c.work
	ownWork := work == ""
	if ownWork {
		if work, err = os.MkdirTemp("", "lazyfork-memfile-"); err != nil {
			return err
		}
	} else if err := os.MkdirAll(work, 0o755); err != nil {
		return err
	}
	if work, err = filepath.Abs(work); err != nil {
		return err
	}

	var loop *memloop.Loop
	storeRoot := ""
	if c.plain {
		loop = &memloop.Loop{}
	} else {
		storeRoot = c.store
		if storeRoot == "" {
			storeRoot = filepath.Join(work, "mem")
		}
		if loop, err = memloop.Open(storeRoot, c.family, c.tmpfsSize); err != nil {
			if ownWork {
				os.RemoveAll(work)
			}
			return err
		}
	}
	loop.Criu = c.criu
	loop.Guard = c.guard

	var (
		wl     *criurun.Workload
		snaps  []*memloop.Snapshot
		copies []*memloop.Copy
	)
	defer func() {
		// --keep keeps a successful run's copies; a failed run leaves nothing.
		if c.keep && err == nil {
			return
		}
		// Copies first: they map the files; then the snapshots' holds, the workload
		// this tool started, the tmpfs and the work directory.
		cerr := loop.Kill(copies...)
		for _, s := range snaps {
			cerr = errors.Join(cerr, loop.Release(s))
		}
		if wl != nil {
			cerr = errors.Join(cerr, wl.Kill())
		}
		cerr = errors.Join(cerr, loop.Close())
		if ownWork {
			cerr = errors.Join(cerr, os.RemoveAll(work))
		}
		if cerr != nil {
			err = errors.Join(err, fmt.Errorf("cleanup: %w", cerr))
		}
	}()

	// The workload.
	source, what := c.pid, ""
	switch {
	case c.pid != 0:
		ok, err := procfs.IsPIDNSInit(c.pid)
		if err != nil {
			return fmt.Errorf("--pid %d: %w", c.pid, err)
		}
		if !ok && !c.plain || !ok && c.n > 0 {
			return fmt.Errorf("--pid %d is not PID 1 of its own PID namespace: its copies would need the PIDs it still holds; start it with `unshare --pid --fork setsid PROG`, or let this tool start it with --cmd", c.pid)
		}
		what = fmt.Sprintf("pid %d", c.pid)
	default:
		args := c.cmd
		var env []string // nil: this tool's environment
		if c.workload != "" {
			if !c.guard {
				env = workloads.Env(c.workload)
			}
			if args, err = workloads.Command(ctx, c.workload, filepath.Join(work, "bin"), c.heapMiB, 100); err != nil {
				return err
			}
			what = fmt.Sprintf("built-in %s workload, %d MiB heap", c.workload, c.heapMiB)
		} else {
			what = strconv.Quote(strings.Join(args, " "))
		}
		out := filepath.Join(work, "parent.out")
		if wl, err = criurun.Start(args, criurun.StartOptions{Stdout: out, Env: env}); err != nil {
			return err
		}
		source = wl.PID
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(c.settle):
		}
		if exited, werr := wl.Exited(); exited {
			return fmt.Errorf("the workload exited during --settle (%v); its output:\n%s", werr, lastLines(out, 10))
		}
	}
	parentMem, err := procfs.TreeMem(source)
	if err != nil {
		return err
	}

	var gens []genRow
	var rows []copyRow
	failed := 0
	for gen := 1; gen <= c.generations; gen++ {
		s, err := loop.Snapshot(ctx, source, filepath.Join(work, fmt.Sprintf("gen%d", gen)))
		if err != nil {
			return fmt.Errorf("generation %d: %w", gen, err)
		}
		snaps = append(snaps, s)
		outs := make([]string, c.n)
		for i := range outs {
			outs[i] = filepath.Join(work, fmt.Sprintf("gen%d-copy%d.out", gen, i))
		}
		cs, wall, err := loop.Restore(ctx, s.Dir, outs)
		if err != nil {
			return fmt.Errorf("generation %d: %w", gen, err)
		}
		copies = append(copies, cs...)
		gens = append(gens, genRow{gen, s, wall})
		first := len(rows)
		for i, cp := range cs {
			m, err := procfs.TreeMem(cp.PID)
			check := "-"
			if err != nil {
				check = "gone: " + err.Error()
				failed++
			}
			rows = append(rows, copyRow{gen: gen, idx: i, copy: cp, mem: m, check: check})
		}
		if c.workload != "" && c.verify {
			for i := first; i < len(rows); i++ {
				if rows[i].check != "-" {
					continue
				}
				vctx, cancel := context.WithTimeout(ctx, time.Minute)
				v, err := workloads.Output(rows[i].copy.Out).Verify(vctx, rows[i].copy.PID)
				cancel()
				switch {
				case err != nil:
					rows[i].check = "no answer: " + err.Error()
					failed++
				case v.OK():
					rows[i].check = "ok"
				default:
					rows[i].check = "FAILED: " + v.Line
					failed++
				}
			}
		}
		source = cs[0].PID
	}

	report(w, c, what, storeRoot, parentMem, gens, rows)
	if c.keep {
		var pids []string
		for _, cp := range copies {
			pids = append(pids, strconv.Itoa(cp.PID))
		}
		fmt.Fprintf(w, "\nkept: work dir %s", work)
		if storeRoot != "" {
			fmt.Fprintf(w, ", store %s (tmpfs; umount it when done)", storeRoot)
		}
		fmt.Fprintf(w, "\nstop the copies with: kill -9 %s\n", strings.Join(pids, " "))
		if wl != nil {
			fmt.Fprintf(w, "and the workload with: kill -9 %d\n", wl.PID)
		}
	}
	if failed > 0 {
		return fmt.Errorf("%d copies failed their check", failed)
	}
	return nil
}

func report(w io.Writer, c *config, what, store string, parent procfs.Mem, gens []genRow, rows []copyRow) {
	mode := "memfile rewrite"
	if c.guard {
		mode += " + madvise guard (refuse)"
	}
	if c.plain {
		mode = "plain CRIU (no rewrite)"
	}
	fmt.Fprintf(w, "workload: %s\nmode: %s; %d copies x %d generation(s)\n", what, mode, c.n, c.generations)
	if store != "" {
		fmt.Fprintf(w, "store: %s (family %s)\n", store, c.family)
	}
	fmt.Fprintf(w, "parent: RssAnon %s, Pss %s, RssShmem %s\n\n", mib(parent.RssAnon), mib(parent.Pss), mib(parent.RssShmem))

	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(tw, "gen\tdump\timage left\trewrite\tmoved\tkept\tthroughput\trebased\trestore wall\t")
	for _, g := range gens {
		rw, moved, kept, tp, rebased := "-", "-", "-", "-", "-"
		if r := g.snap.Rewrite; r != nil {
			rw = ms(r.Duration)
			moved = mib(int64(r.PagesMoved) * 4096)
			kept = mib(int64(r.PagesKept) * 4096)
			if r.Duration > 0 {
				tp = fmt.Sprintf("%.2f GiB/s", float64(r.BytesWritten)/r.Duration.Seconds()/(1<<30))
			}
			rebased = strconv.FormatBool(r.Rebased)
		}
		fmt.Fprintf(tw, "%d\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s (%d at once)\t\n", g.gen, ms(g.snap.Dump.Duration),
			mib(g.snap.ImageBytes), rw, moved, kept, tp, rebased, ms(g.wall), c.n)
	}
	tw.Flush()
	fmt.Fprintln(w)
	tw = tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	fmt.Fprintln(tw, "gen\tcopy\tpid\trestore\t(criu's own)\tpages restored\tRssAnon\tPss\tRssShmem\tcheck")
	for _, r := range rows {
		fmt.Fprintf(tw, "%d\t%d\t%d\t%s\t%s\t%d\t%s\t%s\t%s\t%s\n", r.gen, r.idx, r.copy.PID, ms(r.copy.Restore),
			ms(r.copy.CRIUTime), r.copy.PagesRestored,
			mib(r.mem.RssAnon), mib(r.mem.Pss), mib(r.mem.RssShmem), r.check)
	}
	tw.Flush()
	fmt.Fprintln(w, "\nmemory per copy is read right after its restore (before any check runs)")
}

func ms(d time.Duration) string { return fmt.Sprintf("%.1f ms", float64(d.Microseconds())/1000) }

func mib(b int64) string {
	if b < 1<<20 {
		return fmt.Sprintf("%d kB", b>>10)
	}
	return fmt.Sprintf("%.1f MiB", float64(b)/(1<<20))
}

func lastLines(path string, n int) string {
	ls := workloads.Output(path).Lines()
	if len(ls) > n {
		ls = ls[len(ls)-n:]
	}
	return strings.Join(ls, "\n")
}
