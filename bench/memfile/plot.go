package main

import (
	"github.com/lazyfork/lazyfork/bench/internal/plot"
)

// writePlot draws two log-log panels against heap size: restore time per copy
// and memory per copy, memfile beside plain CRIU.
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
	const blue, red, green, brown = 0, 1, 2, 3
	msOf := func(r row) float64 { return float64(r.Restore1.Microseconds()) / 1000 }
	msOf10 := func(r row) float64 { return float64(r.Restore10Mean.Microseconds()) / 1000 }
	mib := func(b int64) float64 { return float64(b) / (1 << 20) }
	panel := func(title string, ss ...plot.Series) plot.Panel {
		return plot.Panel{Title: title, XLabel: "HEAP (MIB)", LogX: true, LogY: true, XTicks: heaps, LegendBelow: true, Series: ss}
	}
	return plot.WritePNG(path, "LAZYFORK MEMFILE RESTORE VS PLAIN CRIU RESTORE (C GLIBC WORKLOAD)",
		panel("RESTORE TIME PER COPY (MS)",
			pick("MEMFILE, 1 COPY", "memfile", false, blue, msOf),
			pick("MEMFILE, 10 AT ONCE (MEAN)", "memfile", true, blue, msOf10),
			pick("PLAIN, 1 COPY", "plain", false, red, msOf),
			pick("PLAIN, 10 AT ONCE (MEAN)", "plain", true, red, msOf10)),
		panel("MEMORY PER COPY (MIB)",
			pick("MEMFILE RSSANON AFTER RESTORE", "memfile", false, blue, func(r row) float64 { return mib(r.After.RssAnon) }),
			pick("MEMFILE PSS AFTER 5 S", "memfile", false, green, func(r row) float64 { return mib(r.After5s.Pss) }),
			pick("MEMFILE RSSSHMEM AFTER 5 S", "memfile", true, brown, func(r row) float64 { return mib(r.After5s.RssShmem) }),
			pick("PLAIN RSSANON AFTER RESTORE", "plain", false, red, func(r row) float64 { return mib(r.After.RssAnon) })))
}
