package main

import (
	"fmt"
	"strconv"
	"time"

	"github.com/lazyfork/lazyfork/bench/internal/plot"
	"github.com/lazyfork/lazyfork/bench/internal/report"
)

// plot draws the run: median times of the checkpoint and restores, and the
// memory of the parent and of every copy of the last run.
func (r *result) plot(path string) error {
	med := func(f func(*round) time.Duration) float64 {
		m, _, _ := r.median(f)
		return m.Seconds()
	}
	n := r.copies
	times := plot.Panel{
		Title:      fmt.Sprintf("TIME (S), MEDIAN OF %d RUNS", len(r.rounds)),
		YLabel:     "S",
		Categories: []string{"CHECKPOINT", "1 COPY", fmt.Sprintf("%d WALL", n), fmt.Sprintf("%d PER COPY", n)},
		Series: []plot.Series{{Name: "PLAIN CRIU", Y: []float64{
			med(func(rd *round) time.Duration { return rd.ckpt }),
			med(func(rd *round) time.Duration { return rd.one.Restore }),
			med(func(rd *round) time.Duration { return rd.manyWall }),
			med(func(rd *round) time.Duration { return report.Median(restoreTimes(rd.many)) }),
		}}},
		LegendBelow: true,
	}
	last := r.rounds[len(r.rounds)-1]
	cats := []string{"PARENT", "ONE"}
	mem := []float64{float64(r.parentMem) / 1e6, float64(last.oneMem) / 1e6}
	for i, m := range last.manyMem {
		cats = append(cats, strconv.Itoa(i+1))
		mem = append(mem, float64(m)/1e6)
	}
	mems := plot.Panel{
		Title:       "CGROUP MEMORY PER CONTAINER (MB)",
		YLabel:      "MB",
		XLabel:      fmt.Sprintf("COPIES 1..%d RESTORED AT ONCE", n),
		Categories:  cats,
		Series:      []plot.Series{{Name: "PLAIN CRIU", Y: mem}},
		LegendBelow: true,
	}
	return plot.WritePNG(path, fmt.Sprintf("BASELINE: PLAIN RUNC + CRIU, PYTHON HOLDING %d MIB", r.heapMiB), times, mems)
}
