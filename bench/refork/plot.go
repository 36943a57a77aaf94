package main

import (
	"fmt"

	"github.com/lazyfork/lazyfork/bench/internal/plot"
)

// writePlot draws, against the call index, the parent's pause and the tmpfs
// bytes each call added: one colour per heap size, solid for the parent that
// moves onto its memory file, dashed for the opt-out.
func writePlot(path string, cfg config, r *results) error {
	mk := func(heap int, mode string, y func(call) float64) plot.Series {
		color := 0
		for i, h := range cfg.heaps {
			if h == heap {
				color = i
			}
		}
		name := fmt.Sprintf("%d MIB MOVE", heap)
		if mode == modeOff {
			name = fmt.Sprintf("%d MIB OPT-OUT", heap)
		}
		s := plot.Series{Name: name, Color: plot.Palette[color%len(plot.Palette)], Dashed: mode == modeOff}
		for _, c := range r.series(heap, mode) {
			if c.index >= 1 {
				s.X = append(s.X, float64(c.index))
				s.Y = append(s.Y, y(c))
			}
		}
		return s
	}
	var ticks []float64
	for i := 1; i <= cfg.calls; i++ {
		ticks = append(ticks, float64(i))
	}
	panel := func(title string, logY bool, y func(call) float64) plot.Panel {
		p := plot.Panel{Title: title, XLabel: "CALL", LogY: logY, XTicks: ticks, LegendBelow: true}
		for _, h := range cfg.heaps {
			for _, mode := range modes {
				p.Series = append(p.Series, mk(h, mode, y))
			}
		}
		return p
	}
	return plot.WritePNG(path, "LAZYFORK: TEN SUCCESSIVE FORKS OF A RUNNING PARENT (1 MB WRITTEN BETWEEN CALLS)",
		panel("PARENT PAUSED (MS)", true, func(c call) float64 { return c.paused.Seconds() * 1000 }),
		panel("TMPFS ADDED BY THE CALL (MB)", true, func(c call) float64 { return float64(c.tmpfsAdded) / 1e6 }))
}
