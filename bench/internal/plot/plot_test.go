package plot

import (
	"image/png"
	"os"
	"path/filepath"
	"testing"
)

func TestNiceScale(t *testing.T) {
	for _, c := range []struct{ v, top, step float64 }{
		{0, 1, 0.25}, {0.58, 0.6, 0.2}, {4.84, 5, 1}, {278, 300, 100}, {2776, 3000, 1000}, {1, 1, 0.2},
	} {
		top, step := niceScale(c.v)
		if top < c.v || top-c.top > 1e-9 || c.top-top > 1e-9 || step-c.step > 1e-9 || c.step-step > 1e-9 {
			t.Errorf("niceScale(%v) = %v, %v; want %v, %v", c.v, top, step, c.top, c.step)
		}
	}
}

func TestWritePNG(t *testing.T) {
	path := filepath.Join(t.TempDir(), "x.png")
	err := WritePNG(path, "title 1.5 MB", Panel{
		Title: "bars", Categories: []string{"1", "10"},
		Series: []Series{{Name: "baseline", Y: []float64{0.6, 4.8}}, {Name: "lazyfork", Y: []float64{0.15, 0.7}}},
	}, Panel{Title: "lines", Series: []Series{{Name: "a", X: []float64{64, 256, 1024}, Y: []float64{1, 2, 3}}}})
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
	if b := img.Bounds(); b.Dx() != 20+2*panelW || b.Dy() != panelH+50 {
		t.Errorf("size %v", b)
	}
}

// Log axes leave out what they cannot show (zero, negative) and a legend below
// makes the image taller by a line a series.
func TestLogAxesLegendBelow(t *testing.T) {
	p := Panel{LogX: true, LogY: true, LegendBelow: true, XTickLabel: func(x float64) string { return short(x) + " MIB" },
		Series: []Series{
			{Name: "solid", X: []float64{64, 256, 1024}, Y: []float64{0.01, 0, 3}},
			{Name: "dashed", X: []float64{64, 256, 1024}, Y: []float64{2e-5, 1e-3, -1}, Dashed: true},
		}}
	img := Render("log", p)
	if b := img.Bounds(); b.Dy() != panelH+50+2*legendLine+8 {
		t.Errorf("size %v", b)
	}
	if got := short(2e-5); got != "2e-05" {
		t.Errorf("short(2e-5) = %q", got)
	}
}
