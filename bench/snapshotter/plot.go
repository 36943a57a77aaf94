package main

import (
	"github.com/lazyfork/lazyfork/bench/internal/plot"
)

// plotSeries picks the lines of the plot out of the results: time per fork
// against the parent's upper layer size, per filesystem and method.
func plotSeries(rs []result) []plot.Series {
	pick := func(name string, color int, fs, method string, y func(result) float64) plot.Series {
		s := plot.Series{Name: name, Color: plot.Palette[color]}
		for _, r := range rs {
			if r.FS == fs && r.Method == method {
				s.X = append(s.X, float64(r.SizeBytes))
				s.Y = append(s.Y, y(r))
			}
		}
		return s
	}
	perFork := func(r result) float64 { return r.PerForkSec }
	pause := func(r result) float64 { return r.ParentPause }
	prep := func(r result) float64 { return r.PrepareSec }
	out := []plot.Series{
		pick("EXT4 COPY PER FORK", 1, "ext4", "copy-per-fork", perFork),
		pick("EXT4 FROZEN LAYER, TOTAL PER FORK", 0, "ext4", "frozen-layer", perFork),
		pick("EXT4 FROZEN LAYER, PARENT PAUSE", 2, "ext4", "frozen-layer", pause),
		pick("EXT4 PREPARE ON FROZEN LAYER", 4, "ext4", "frozen-layer", prep),
		pick("XFS FROZEN LAYER, TOTAL PER FORK", 3, "xfs", "frozen-layer", perFork),
	}
	var keep []plot.Series
	for _, s := range out {
		if len(s.X) > 0 {
			keep = append(keep, s)
		}
	}
	return keep
}

func writePlot(path string, rs []result) error {
	return plot.WritePNG(path, "FORK ROOTFS COST VS PARENT UPPER LAYER SIZE (LOG-LOG)", plot.Panel{
		Title:  "TIME (S)",
		XLabel: "PARENT UPPER LAYER",
		LogX:   true, LogY: true, LegendBelow: true,
		XTickLabel: func(x float64) string { return human(int64(x)) },
		Series:     plotSeries(rs),
	})
}
