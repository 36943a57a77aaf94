package main

import (
	"fmt"
	"math"
	"slices"

	"github.com/lazyfork/lazyfork/bench/internal/plot"
)

// plotSeries picks the lines of the plot out of the results: time per fork
// against the parent's upper layer size, per filesystem and method, each
// point the median of the runs with their minimum and maximum as error bar.
func plotSeries(rs []result) []plot.Series {
	pick := func(name string, color int, fs, method string, y func(result) float64) plot.Series {
		s := plot.Series{Name: name, Color: plot.Palette[color]}
		for _, r := range rs {
			if r.FS == fs && r.Method == method {
				s.X = append(s.X, float64(r.SizeBytes))
				s.Y = append(s.Y, y(r))
				lo, hi := math.NaN(), math.NaN()
				if len(r.runs) > 1 {
					lo, hi = math.Inf(1), math.Inf(-1)
					for _, run := range r.runs {
						lo, hi = min(lo, y(run)), max(hi, y(run))
					}
				}
				s.Lo, s.Hi = append(s.Lo, lo), append(s.Hi, hi)
			}
		}
		return s
	}
	perFork := func(r result) float64 { return r.PerForkSec }
	pause := func(r result) float64 { return r.ParentPause }
	prep := func(r result) float64 { return r.PrepareSec }
	return []plot.Series{
		pick("ext4: copy per fork", 1, "ext4", "copy-per-fork", perFork),
		pick("ext4: frozen layer, total per fork", 0, "ext4", "frozen-layer", perFork),
		pick("ext4: frozen layer, parent pause", 2, "ext4", "frozen-layer", pause),
		pick("ext4: prepare on the frozen layer", 4, "ext4", "frozen-layer", prep),
		pick("xfs: frozen layer, total per fork", 3, "xfs", "frozen-layer", perFork),
	}
}

func writePlot(path string, rs []result) error {
	var sizes []float64
	runs, bars := 0, ""
	for _, r := range rs {
		if len(r.runs) > 1 {
			bars = "; bars: min..max"
		}
		if !slices.Contains(sizes, float64(r.SizeBytes)) {
			sizes = append(sizes, float64(r.SizeBytes))
		}
		runs = max(runs, r.Runs)
	}
	slices.Sort(sizes)
	return plot.WritePNG(path, "Fork rootfs cost vs the parent's upper layer size", plot.Panel{
		Title:  fmt.Sprintf("Time (median of %d runs%s)", runs, bars),
		XLabel: "parent upper layer",
		YLabel: "seconds",
		LogX:   true, LogY: true, LegendBelow: true,
		XTicks:     sizes,
		XTickLabel: func(x float64) string { return human(int64(x)) },
		Series:     plotSeries(rs),
	})
}
