package main

import (
	"fmt"

	"github.com/lazyfork/lazyfork/bench/internal/plot"
)

// writePlot draws three log-log panels against heap size: restore per fork,
// how long the parent is paused for a snapshot, and memory per fork.
func writePlot(path string, heaps []int, nForks int, r *results) error {
	xs := make([]float64, len(heaps))
	for i, h := range heaps {
		xs[i] = float64(h)
	}
	const lf, plain, lf2, shim = 0, 1, 2, 3 // palette: blue, red, green, brown
	mk := func(name string, color int, dashed bool, system, metric string, scale float64) plot.Series {
		s := plot.Series{Name: name, Color: plot.Palette[color], Dashed: dashed}
		for _, h := range heaps {
			if v, ok := r.get(h, system, metric); ok && v > 0 {
				s.X = append(s.X, float64(h))
				s.Y = append(s.Y, v*scale)
			}
		}
		return s
	}
	many := fmt.Sprintf("restore_%d_median", nForks)
	panel := func(title string, ss ...plot.Series) plot.Panel {
		return plot.Panel{Title: title, XLabel: "HEAP MIB", LogX: true, LogY: true, XTicks: xs, LegendBelow: true, Series: ss}
	}
	return plot.WritePNG(path, "LAZYFORK FORK VS PLAIN RUNC CHECKPOINT/RESTORE, PYTHON COUNTER",
		panel("RESTORE PER FORK (MS)",
			mk("LAZYFORK 1 FORK", lf, false, "lazyfork", "restore_1", 1000),
			mk(fmt.Sprintf("LAZYFORK %d AT ONCE (MEDIAN)", nForks), lf, true, "lazyfork", many, 1000),
			mk("PLAIN 1 COPY", plain, false, "plain", "restore_1", 1000),
			mk(fmt.Sprintf("PLAIN %d AT ONCE (MEDIAN)", nForks), plain, true, "plain", many, 1000),
			mk("FORK OF A FORK", lf2, false, "lazyfork", "fork_of_fork_restore", 1000)),
		panel("PARENT PAUSED FOR SNAPSHOT (MS)",
			mk("LAZYFORK DUMP+REWRITE", lf, false, "lazyfork", "snapshot_pause", 1000),
			mk("PLAIN DUMP", plain, false, "plain", "snapshot_pause", 1000),
			mk("FORK OF A FORK", lf2, false, "lazyfork", "fork_of_fork_pause", 1000)),
		panel("MEMORY PER FORK (MB)",
			mk("LAZYFORK AFTER RESTORE", lf, false, "lazyfork", "memory_after_restore_median", 1e-6),
			mk("LAZYFORK AFTER 5 S", lf, true, "lazyfork", "memory_after_5s_median", 1e-6),
			mk("SHIM RSS / FORKS", shim, false, "lazyfork", "shim_rss_per_fork", 1e-6),
			mk("PLAIN AFTER RESTORE", plain, false, "plain", "memory_after_restore_1", 1e-6)))
}
