package main

import (
	"image/color"
	"math"

	"github.com/lazyfork/lazyfork/bench/internal/plot"
	"github.com/lazyfork/lazyfork/bench/internal/report"
)

// plot draws, per allocator, the parent's RssAnon beside the mean RssAnon of
// its forks in each mode, with the forks' min..max as error bars: a grouped
// bar chart.
func writePlot(path string, rows []row) error {
	type key struct{ alloc, series string }
	vals := map[key][]float64{}
	var allocs []string
	seen := map[string]bool{}
	for _, r := range rows {
		if !seen[r.Alloc] {
			seen[r.Alloc] = true
			allocs = append(allocs, r.Alloc)
		}
		s := "fork, " + r.Mode
		if r.Role == "parent" {
			if r.Mode != "refuse" { // one parent per allocator is enough
				continue
			}
			s = "parent"
		}
		k := key{r.Alloc, s}
		vals[k] = append(vals[k], mb(r.Mem.RssAnon))
	}
	names := []string{"parent", "fork, unguarded", "fork, refuse", "fork, zero"}
	colors := []color.RGBA{{90, 90, 90, 255}, {214, 39, 40, 255}, {31, 119, 180, 255}, {44, 160, 44, 255}}
	var series []plot.Series
	for si, s := range names {
		ps := plot.Series{Name: s, Color: colors[si]}
		for _, a := range allocs {
			v, lo, hi := math.NaN(), math.NaN(), math.NaN() // no bar
			if vs := vals[key{a, s}]; len(vs) > 0 {
				sum := 0.0
				for _, x := range vs {
					sum += x
				}
				v = sum / float64(len(vs))
				if len(vs) > 1 {
					lo, hi = report.Min(vs), report.Max(vs)
				}
			}
			ps.Y, ps.Lo, ps.Hi = append(ps.Y, v), append(ps.Lo, lo), append(ps.Hi, hi)
		}
		series = append(series, ps)
	}
	return plot.WritePNG(path, "Allocators in memory-file forks", plot.Panel{
		Title:      "RssAnon after churn, mean fork per mode (bars: min..max)",
		YLabel:     "MiB",
		Categories: allocs,
		Series:     series,
		BarValues:  true, LegendBelow: true,
	})
}
