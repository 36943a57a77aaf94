package main

import (
	"fmt"
	"strconv"

	"github.com/lazyfork/lazyfork/bench/internal/ctrbench"
	"github.com/lazyfork/lazyfork/bench/internal/plot"
)

// plot draws the run: times of the checkpoint and restores, and the memory of
// the parent and of every copy.
func (r *result) plot(path string) error {
	durs := []float64{r.ckpt.Seconds(), r.one.Start.Seconds(), r.manyWall.Seconds(),
		ctrbench.Median(copyStarts(r.many)).Seconds()}
	n := len(r.many)
	times := plot.Panel{
		Title:      "TIME (S)",
		YLabel:     "S",
		Categories: []string{"CHECKPOINT", "1 COPY", fmt.Sprintf("%d WALL", n), fmt.Sprintf("%d MEDIAN", n)},
		Series:     []plot.Series{{Name: "PLAIN CRIU", Y: durs}},
	}
	cats := []string{"PARENT", "ONE"}
	mem := []float64{float64(r.parentMem) / 1e6, float64(r.oneMem) / 1e6}
	for i, m := range r.manyMem {
		cats = append(cats, strconv.Itoa(i+1))
		mem = append(mem, float64(m)/1e6)
	}
	mems := plot.Panel{
		Title:      "CGROUP MEMORY PER CONTAINER (MB)",
		YLabel:     "MB",
		XLabel:     fmt.Sprintf("COPIES 1..%d RESTORED AT ONCE", n),
		Categories: cats,
		Series:     []plot.Series{{Name: "PLAIN CRIU", Y: mem}},
	}
	return plot.WritePNG(path, fmt.Sprintf("BASELINE: PLAIN RUNC + CRIU, PYTHON HOLDING %d MIB", r.heapMiB), times, mems)
}
