package plot

import (
	"image/png"
	"math"
	"os"
	"path/filepath"
	"testing"
)

func TestWritePNG(t *testing.T) {
	path := filepath.Join(t.TempDir(), "x.png")
	err := WritePNG(path, "title 1.5 MB", Panel{
		Title: "bars", Categories: []string{"1", "10"}, BarValues: true,
		Series: []Series{{Name: "baseline", Y: []float64{0.6, 4.8}, Lo: []float64{0.5, 4}, Hi: []float64{0.7, 5}},
			{Name: "lazyfork", Y: []float64{0.15, math.NaN()}}},
	}, Panel{Title: "lines", LegendBelow: true, Series: []Series{{Name: "a", X: []float64{64, 256, 1024}, Y: []float64{1, 2, 3}}}})
	if err != nil {
		t.Fatal(err)
	}
	f, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	img, err := png.Decode(f)
	if err != nil {
		t.Fatal(err)
	}
	if b := img.Bounds(); b.Dx() != int(2*panelW.Dots(dpi)+0.5) {
		t.Errorf("size %v, want two panels wide", b)
	}
}

// Log axes leave out what they cannot show (zero, negative), a series
// without a point has no legend entry, and the axes span the data.
func TestLogAxesFitTheData(t *testing.T) {
	p := Panel{LogX: true, LogY: true, LegendBelow: true,
		Series: []Series{
			{Name: "solid", X: []float64{64, 256, 1024}, Y: []float64{0.01, 0, 3}},
			{Name: "dashed", X: []float64{64, 256, 1024}, Y: []float64{2e-5, 1e-3, -1}, Dashed: true},
			{Name: "empty", X: []float64{64}, Y: []float64{0}},
		}}
	if got := withData(p); len(got) != 2 {
		t.Errorf("series with data: %v, want the first two", got)
	}
	pl, legend, err := build(p)
	if err != nil {
		t.Fatal(err)
	}
	if legend == nil {
		t.Fatal("no legend below")
	}
	if pl.Y.Min > 2e-5 || pl.Y.Min < 2e-6 || pl.Y.Max < 3 || pl.Y.Max > 30 {
		t.Errorf("y axis %g..%g for data 2e-5..3", pl.Y.Min, pl.Y.Max)
	}
	if pl.X.Min > 64 || pl.X.Min < 32 || pl.X.Max < 1024 || pl.X.Max > 2048 {
		t.Errorf("x axis %g..%g for data 64..1024", pl.X.Min, pl.X.Max)
	}
	// 1 MiB..1 GiB must not run to 10 GB.
	q := Panel{LogX: true, LogY: true, Series: []Series{{X: []float64{1 << 20, 1 << 30}, Y: []float64{0.01, 1}}}}
	pl, _, err = build(q)
	if err != nil {
		t.Fatal(err)
	}
	if pl.X.Max > 3e9 {
		t.Errorf("x axis runs to %g for data ending at %g", pl.X.Max, float64(1<<30))
	}
}

func TestCompact(t *testing.T) {
	for v, want := range map[float64]string{0: "0", 2e-5: "2e-05", 0.25: "0.25", 250: "250", 4020: "4020", 82.25: "82.2", 12000: "12k", 3e6: "3M", 1.5e9: "1.5G"} {
		if got := Compact(v); got != want {
			t.Errorf("Compact(%g) = %q, want %q", v, got, want)
		}
	}
}

// A run at one size draws bars, not lines of single dots.
func TestSingleXBecomesBars(t *testing.T) {
	p := singleX(Panel{LogX: true, LogY: true, XTickLabel: func(x float64) string { return Compact(x) + " MiB" }, Series: []Series{
		{Name: "a", X: []float64{256}, Y: []float64{3}},
		{Name: "b", X: []float64{256}, Y: []float64{5}, Lo: []float64{5}, Hi: []float64{9}},
		{Name: "none", X: []float64{256}, Y: []float64{math.NaN()}},
	}})
	if len(p.Categories) != 1 || p.Categories[0] != "256 MiB" || p.LogY {
		t.Fatalf("got %+v, want one linear category", p)
	}
	if got := withData(p); len(got) != 2 {
		t.Errorf("series with data %v, want a and b", got)
	}
	if _, _, err := build(p); err != nil {
		t.Fatal(err)
	}
}

// A log axis over less than a decade still gets several labels.
func TestLogTicksNarrowRange(t *testing.T) {
	n := 0
	for _, tk := range logTicks(Compact).Ticks(104, 237) {
		if tk.Label != "" {
			n++
		}
	}
	if n < 3 {
		t.Errorf("%d labels on 104..237, want at least 3", n)
	}
}
