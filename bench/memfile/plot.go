package main

import (
	"math"

	"github.com/lazyfork/lazyfork/bench/internal/plot"
)

// writePlot draws two log-log panels against heap size: restore time per copy
// and memory per copy, memfile beside plain CRIU. The mean over copies
// restored at once has an error bar up to the slowest copy.
func writePlot(path string, rows []row) error {
	var heaps []float64
	for _, r := range rows {
		if r.Mode == "memfile" {
			heaps = append(heaps, float64(r.HeapMiB))
		}
	}
	pick := func(name string, mode string, dashed bool, color int, f func(r row) float64) plot.Series {
		s := plot.Series{Name: name, Dashed: dashed, Color: plot.Palette[color]}
		for _, r := range rows {
			if r.Mode == mode {
				s.X = append(s.X, float64(r.HeapMiB))
				s.Y = append(s.Y, f(r))
			}
		}
		return s
	}
	// spread adds error bars from each point up to hi of its row.
	spread := func(s plot.Series, mode string, hi func(r row) float64) plot.Series {
		for _, r := range rows {
			if r.Mode == mode {
				h := hi(r)
				if h <= 0 {
					h = math.NaN()
				}
				s.Lo, s.Hi = append(s.Lo, s.Y[len(s.Lo)]), append(s.Hi, h)
			}
		}
		return s
	}
	const blue, red, green, brown = 0, 1, 2, 3
	msOf := func(r row) float64 { return float64(r.Restore1.Microseconds()) / 1000 }
	msOf10 := func(r row) float64 { return float64(r.Restore10Mean.Microseconds()) / 1000 }
	msMax10 := func(r row) float64 { return float64(r.Restore10Max.Microseconds()) / 1000 }
	mib := func(b int64) float64 { return float64(b) / (1 << 20) }
	panel := func(title, unit string, ss ...plot.Series) plot.Panel {
		return plot.Panel{Title: title, XLabel: "heap (MiB)", YLabel: unit, LogX: true, LogY: true, XTicks: heaps, LegendBelow: true, Series: ss}
	}
	return plot.WritePNG(path, "LazyFork memfile restore vs plain CRIU restore (C glibc workload)",
		panel("Restore time per copy (bars: mean to max)", "ms",
			pick("memfile, 1 copy", "memfile", false, blue, msOf),
			spread(pick("memfile, 10 at once (mean)", "memfile", true, blue, msOf10), "memfile", msMax10),
			pick("plain, 1 copy", "plain", false, red, msOf),
			spread(pick("plain, 10 at once (mean)", "plain", true, red, msOf10), "plain", msMax10)),
		panel("Memory per copy", "MiB",
			pick("memfile RssAnon after restore", "memfile", false, blue, func(r row) float64 { return mib(r.After.RssAnon) }),
			pick("memfile Pss after 5 s", "memfile", false, green, func(r row) float64 { return mib(r.After5s.Pss) }),
			pick("memfile RssShmem after 5 s", "memfile", true, brown, func(r row) float64 { return mib(r.After5s.RssShmem) }),
			pick("plain RssAnon after restore", "plain", false, red, func(r row) float64 { return mib(r.After.RssAnon) })))
}
