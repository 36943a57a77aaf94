package main

import (
	"fmt"
	"math"
	"strings"

	"github.com/lazyfork/lazyfork/bench/internal/plot"
)

// writePlot draws three log-log panels against heap size: restore per fork,
// how long the parent is paused for a snapshot, and memory per fork. A
// median over forks restored at once has an error bar up to the slowest (or
// largest) fork. Run at one heap size, the panels are bars.
func writePlot(path string, heaps []int, nForks int, r *results) error {
	xs := make([]float64, len(heaps))
	for i, h := range heaps {
		xs[i] = float64(h)
	}
	const lf, plain, lf2, shim = 0, 1, 2, 3 // palette: blue, red, green, brown
	mk := func(name string, color int, dashed bool, system, metric string, scale float64) plot.Series {
		s := plot.Series{Name: name, Color: plot.Palette[color], Dashed: dashed}
		maxMetric, spread := strings.CutSuffix(metric, "_median")
		maxMetric += "_max"
		for _, h := range heaps {
			if v, ok := r.get(h, system, metric); ok && v > 0 {
				s.X = append(s.X, float64(h))
				s.Y = append(s.Y, v*scale)
				lo, hi := math.NaN(), math.NaN()
				if m, ok := r.get(h, system, maxMetric); ok && spread {
					lo, hi = v*scale, m*scale
				}
				s.Lo, s.Hi = append(s.Lo, lo), append(s.Hi, hi)
			}
		}
		return s
	}
	many := fmt.Sprintf("restore_%d_median", nForks)
	panel := func(title, unit string, ss ...plot.Series) plot.Panel {
		return plot.Panel{Title: title, XLabel: "heap (MiB)", YLabel: unit, LogX: true, LogY: true, XTicks: xs,
			XTickLabel: func(x float64) string { return fmt.Sprintf("%g MiB", x) }, LegendBelow: true, Series: ss}
	}
	return plot.WritePNG(path, "LazyFork fork vs plain runc checkpoint/restore, python counter (error bars: median to max over forks)",
		panel("Restore per fork", "ms",
			mk("LazyFork, 1 fork", lf, false, "lazyfork", "restore_1", 1000),
			mk(fmt.Sprintf("LazyFork, %d at once (median)", nForks), lf, true, "lazyfork", many, 1000),
			mk("plain, 1 copy", plain, false, "plain", "restore_1", 1000),
			mk(fmt.Sprintf("plain, %d at once (median)", nForks), plain, true, "plain", many, 1000),
			mk("fork of a fork", lf2, false, "lazyfork", "fork_of_fork_restore", 1000)),
		panel("Parent paused for the snapshot", "ms",
			mk("LazyFork dump + rewrite", lf, false, "lazyfork", "snapshot_pause", 1000),
			mk("plain dump", plain, false, "plain", "snapshot_pause", 1000),
			mk("fork of a fork", lf2, false, "lazyfork", "fork_of_fork_pause", 1000)),
		panel("Memory per fork", "MB",
			mk("LazyFork after restore (median)", lf, false, "lazyfork", "memory_after_restore_median", 1e-6),
			mk("LazyFork after 5 s (median)", lf, true, "lazyfork", "memory_after_5s_median", 1e-6),
			mk("shim RSS / forks", shim, false, "lazyfork", "shim_rss_per_fork", 1e-6),
			mk("plain after restore", plain, false, "plain", "memory_after_restore_1", 1e-6)))
}
