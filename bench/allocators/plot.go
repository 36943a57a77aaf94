package main

import (
	"image/color"
	"math"

	"github.com/lazyfork/lazyfork/bench/internal/plot"
)

// plot draws, per allocator, the parent's RssAnon beside the mean RssAnon of
// its forks in each mode: a grouped bar chart.
func writePlot(path string, rows []row) error {
	type key struct{ alloc, series string }
	sum, n := map[key]float64{}, map[key]int{}
	var allocs []string
	seen := map[string]bool{}
	for _, r := range rows {
		if !seen[r.Alloc] {
			seen[r.Alloc] = true
			allocs = append(allocs, r.Alloc)
		}
		s := "FORK " + r.Mode
		if r.Role == "parent" {
			if r.Mode != "refuse" { // one parent per allocator is enough
				continue
			}
			s = "PARENT"
		}
		k := key{r.Alloc, s}
		sum[k] += mb(r.Mem.RssAnon)
		n[k]++
	}
	names := []string{"PARENT", "FORK unguarded", "FORK refuse", "FORK zero"}
	colors := []color.RGBA{{90, 90, 90, 255}, {214, 39, 40, 255}, {31, 119, 180, 255}, {44, 160, 44, 255}}
	var series []plot.Series
	for si, s := range names {
		ps := plot.Series{Name: s, Color: colors[si]}
		for _, a := range allocs {
			v := math.NaN() // no bar
			if k := (key{a, s}); n[k] > 0 {
				v = sum[k] / float64(n[k])
			}
			ps.Y = append(ps.Y, v)
		}
		series = append(series, ps)
	}
	return plot.WritePNG(path, "ALLOCATORS IN MEMORY-FILE FORKS", plot.Panel{
		Title:      "RSSANON MIB AFTER CHURN: PARENT AND MEAN FORK PER MODE",
		YLabel:     "MIB",
		Categories: allocs,
		Series:     series,
		BarValues:  true, LegendBelow: true,
	})
}
