package main

import (
	"fmt"
	"image/color"

	"github.com/lazyfork/lazyfork/bench/internal/plot"
)

// writePlot draws, against the call index, the parent's pause and the tmpfs
// bytes each call added: one colour per heap size, solid for the parent that
// moves onto its memory file (lighter when it writes one run of pages),
// dashed for the opt-out.
func writePlot(path string, cfg config, r *results) error {
	mk := func(heap int, mode string, y func(call) float64) plot.Series {
		idx := 0
		for i, h := range cfg.heaps {
			if h == heap {
				idx = i
			}
		}
		c := plot.Palette[idx%len(plot.Palette)]
		name := fmt.Sprintf("%d MiB, move (spread writes)", heap)
		switch mode {
		case modeMoveRun:
			name = fmt.Sprintf("%d MiB, move (one run of pages)", heap)
			c = color.RGBA{R: c.R/2 + 128, G: c.G/2 + 128, B: c.B/2 + 128, A: 255} // a lighter shade
		case modeMoveEach:
			name = fmt.Sprintf("%d MiB, move at each snapshot (spread writes)", heap)
			c = color.RGBA{R: c.R / 2, G: c.G / 2, B: c.B / 2, A: 255} // a darker shade
		case modeOff:
			name = fmt.Sprintf("%d MiB, opt-out", heap)
		}
		s := plot.Series{Name: name, Color: c, Dashed: mode == modeOff}
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
		p := plot.Panel{Title: title, XLabel: "call", LogY: logY, XTicks: ticks, LegendBelow: true}
		for _, h := range cfg.heaps {
			for _, mode := range modes {
				p.Series = append(p.Series, mk(h, mode, y))
			}
		}
		return p
	}
	return plot.WritePNG(path, "LazyFork: ten successive forks of a running parent (1 MB written between calls)",
		panel("Parent paused (ms)", true, func(c call) float64 { return c.paused.Seconds() * 1000 }),
		panel("tmpfs added by the call (MB)", true, func(c call) float64 { return float64(c.tmpfsAdded) / 1e6 }))
}
