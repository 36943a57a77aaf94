package main

import (
	"fmt"
	"strconv"
	"time"

	"github.com/lazyfork/lazyfork/bench/internal/plot"
	"github.com/lazyfork/lazyfork/bench/internal/report"
)

// plot draws the run: median times of the checkpoint and restores (error
// bars: min..max over the runs), and the memory of the parent and of every
// copy of the last run.
func (r *result) plot(path string) error {
	n := r.copies
	s := plot.Series{Name: "plain CRIU (bars: min..max over runs)"}
	for _, f := range []func(*round) time.Duration{
		func(rd *round) time.Duration { return rd.ckpt },
		func(rd *round) time.Duration { return rd.one.Restore },
		func(rd *round) time.Duration { return rd.manyWall },
		func(rd *round) time.Duration { return report.Median(restoreTimes(rd.many)) },
	} {
		m, lo, hi := r.median(f)
		s.Y, s.Lo, s.Hi = append(s.Y, m.Seconds()), append(s.Lo, lo.Seconds()), append(s.Hi, hi.Seconds())
	}
	times := plot.Panel{
		Title:       fmt.Sprintf("Time, median of %d runs", len(r.rounds)),
		YLabel:      "s",
		Categories:  []string{"checkpoint", "1 copy", fmt.Sprintf("%d at once, wall", n), fmt.Sprintf("%d at once, per copy", n)},
		Series:      []plot.Series{s},
		BarValues:   true,
		LegendBelow: true,
	}
	last := r.rounds[len(r.rounds)-1]
	cats := []string{"parent", "one"}
	mem := []float64{float64(r.parentMem) / 1e6, float64(last.oneMem) / 1e6}
	for i, m := range last.manyMem {
		cats = append(cats, strconv.Itoa(i+1))
		mem = append(mem, float64(m)/1e6)
	}
	mems := plot.Panel{
		Title:       "cgroup memory per container (last run)",
		YLabel:      "MB",
		XLabel:      fmt.Sprintf("copies 1..%d restored at once", n),
		Categories:  cats,
		Series:      []plot.Series{{Name: "plain CRIU", Y: mem}},
		LegendBelow: true,
	}
	return plot.WritePNG(path, fmt.Sprintf("Baseline: plain runc + CRIU, python holding %d MiB", r.heapMiB), times, mems)
}
