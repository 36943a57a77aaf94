// Package plot draws simple benchmark charts as PNG with the standard library
// only: panels side by side, each a line chart (X/Y series, linear or
// logarithmic axes) or a grouped bar chart (categories), with tick labels, a
// legend and a built-in 3x5 pixel font. Enough to see a result at a glance; the
// CSV next to the PNG holds the exact figures.
package plot

import (
	"fmt"
	"image"
	"image/color"
	"image/png"
	"io"
	"math"
	"slices"
	"strconv"
	"strings"

	"github.com/lazyfork/lazyfork/bench/internal/report"
)

// Series is one line (or one bar per category).
type Series struct {
	Name string
	X    []float64 // line charts only; nil means 1, 2, 3...
	Y    []float64
	// Color overrides the palette colour (zero: Palette[i]); two series of one
	// system can share a colour, one Dashed.
	Color  color.RGBA
	Dashed bool
}

// Panel is one chart.
type Panel struct {
	Title  string
	XLabel string
	YLabel string
	// Categories makes a grouped bar chart: Series[s].Y[i] is the bar of series s
	// in category i.
	Categories []string
	Series     []Series

	// LogX and LogY make a line chart's axes logarithmic (decades on Y);
	// points that are not positive on a log axis are left out.
	LogX, LogY bool
	// XTicks are the X values labelled on a line chart (nil: min, middle and
	// max; with LogX every distinct X); XTickLabel formats them (nil: compact).
	XTicks     []float64
	XTickLabel func(float64) string
	// BarValues writes each bar's value above it.
	BarValues bool
	// LegendBelow puts the legend under the chart, one series a line, for
	// long names; otherwise it sits top right inside the chart.
	LegendBelow bool
}

// Palette is the series colours, in order.
var Palette = []color.RGBA{
	{31, 100, 200, 255}, {210, 60, 40, 255}, {40, 150, 70, 255},
	{150, 100, 40, 255}, {130, 60, 170, 255}, {20, 150, 160, 255},
}

var (
	white = color.RGBA{255, 255, 255, 255}
	black = color.RGBA{0, 0, 0, 255}
	grey  = color.RGBA{220, 220, 220, 255}
)

const (
	panelW = 620
	panelH = 460
	scale  = 2 // font pixel size

	legendLine = 16
)

// WritePNG renders the panels under a title and writes the PNG atomically.
func WritePNG(path, title string, panels ...Panel) error {
	img := Render(title, panels...)
	return report.WriteFileAtomic(path, func(w io.Writer) error { return png.Encode(w, img) })
}

// Render draws the panels side by side under title.
func Render(title string, panels ...Panel) *image.RGBA {
	n := max(len(panels), 1)
	extra := 0
	for _, p := range panels {
		if p.LegendBelow {
			extra = max(extra, legendLine*len(p.Series)+8)
		}
	}
	w := max(20+n*panelW, 40+textWidth(title, 3)) // a long title widens the image
	img := image.NewRGBA(image.Rect(0, 0, w, panelH+50+extra))
	fillRect(img, img.Bounds(), white)
	drawText(img, 20, 14, 3, black, title)
	for i, p := range panels {
		drawPanel(img, image.Rect(10+i*panelW, 50, 10+(i+1)*panelW, 50+panelH), p)
	}
	return img
}

func drawPanel(img *image.RGBA, r image.Rectangle, p Panel) {
	area := image.Rect(r.Min.X+80, r.Min.Y+40, r.Max.X-20, r.Max.Y-60)
	drawText(img, r.Min.X+80, r.Min.Y+8, scale, black, p.Title)
	drawText(img, area.Min.X, area.Max.Y+38, scale, black, p.XLabel)
	drawText(img, r.Min.X+4, r.Min.Y+26, scale, black, p.YLabel)

	yPix := yAxis(img, area, p)
	if len(p.Categories) > 0 {
		drawBars(img, area, p, yPix)
	} else {
		drawLines(img, area, p, yPix)
	}
	// Axes.
	hline(img, area.Min.X, area.Max.X, area.Max.Y, black)
	vline(img, area.Min.X, area.Min.Y, area.Max.Y, black)

	drawLegend(img, area, r, p)
}

// yAxis draws the Y grid and tick labels and returns the value -> pixel map:
// linear from zero to a round top, or decades with LogY on a line chart.
func yAxis(img *image.RGBA, area image.Rectangle, p Panel) func(float64) int {
	tick := func(v float64, y int) {
		hline(img, area.Min.X, area.Max.X, y, grey)
		label := short(v)
		drawText(img, area.Min.X-8-textWidth(label, scale), y-5, scale, black, label)
	}
	if p.LogY && len(p.Categories) == 0 {
		lo, hi := math.Inf(1), math.Inf(-1)
		for _, s := range p.Series {
			for _, y := range s.Y {
				if usable(y, true) {
					lo, hi = math.Min(lo, y), math.Max(hi, y)
				}
			}
		}
		if math.IsInf(lo, 1) {
			lo, hi = 1, 10
		}
		elo, ehi := math.Floor(math.Log10(lo)), math.Ceil(math.Log10(hi))
		if ehi <= elo {
			ehi = elo + 1
		}
		yPix := func(y float64) int {
			return area.Max.Y - int(math.Round((math.Log10(y)-elo)/(ehi-elo)*float64(area.Dy())))
		}
		for e := elo; e <= ehi; e++ {
			v := math.Pow(10, e)
			tick(v, yPix(v))
		}
		return yPix
	}
	ymax := 0.0
	for _, s := range p.Series {
		for _, y := range s.Y {
			if usable(y, false) {
				ymax = math.Max(ymax, y)
			}
		}
	}
	top, step := niceScale(ymax)
	yPix := func(y float64) int {
		return area.Max.Y - int(math.Round(y/top*float64(area.Dy())))
	}
	for v := 0.0; v <= top*1.0001; v += step {
		tick(v, yPix(v))
	}
	return yPix
}

// usable says whether v can be drawn (finite; positive on a log axis).
func usable(v float64, log bool) bool {
	return !math.IsNaN(v) && !math.IsInf(v, 0) && (!log || v > 0)
}

// drawLegend writes the series names with their colours: top right inside the
// chart, or under the panel r with LegendBelow.
func drawLegend(img *image.RGBA, area, r image.Rectangle, p Panel) {
	bars := len(p.Categories) > 0
	y := area.Min.Y + 6
	if p.LegendBelow {
		y = r.Max.Y + 4
	}
	for i, s := range p.Series {
		x := area.Max.X - 16 - textWidth(s.Name, scale)
		if p.LegendBelow {
			x = area.Min.X + 20
		}
		c := colorOf(s, i)
		if bars {
			fillRect(img, image.Rect(x-16, y, x-4, y+10), c)
		} else {
			line(img, x-22, y+4, x-6, y+4, c, s.Dashed)
		}
		drawText(img, x, y, scale, black, s.Name)
		y += legendLine
	}
}

func colorOf(s Series, i int) color.RGBA {
	if s.Color != (color.RGBA{}) {
		return s.Color
	}
	return Palette[i%len(Palette)]
}

func drawBars(img *image.RGBA, area image.Rectangle, p Panel, yPix func(float64) int) {
	nc := len(p.Categories)
	ns := max(len(p.Series), 1)
	groupW := float64(area.Dx()) / float64(nc)
	barW := max(int(groupW*0.8)/ns, 1)
	for ci, cat := range p.Categories {
		gx := area.Min.X + int(float64(ci)*groupW+groupW*0.1)
		for si, s := range p.Series {
			if ci >= len(s.Y) || math.IsNaN(s.Y[ci]) {
				continue
			}
			x := gx + si*barW
			fillRect(img, image.Rect(x, yPix(s.Y[ci]), x+barW-1, area.Max.Y), colorOf(s, si))
			if p.BarValues {
				l := short(round3(s.Y[ci]))
				drawText(img, x+(barW-1-textWidth(l, 1))/2, yPix(s.Y[ci])-8, 1, black, l)
			}
		}
		lw := textWidth(cat, scale)
		drawText(img, gx+int(groupW*0.4)-lw/2, area.Max.Y+8, scale, black, cat)
	}
}

func drawLines(img *image.RGBA, area image.Rectangle, p Panel, yPix func(float64) int) {
	xsOf := func(s Series) []float64 {
		if s.X != nil {
			return s.X
		}
		xs := make([]float64, len(s.Y))
		for i := range xs {
			xs[i] = float64(i + 1)
		}
		return xs
	}
	ok := func(x, y float64) bool { return usable(x, p.LogX) && usable(y, p.LogY) }
	var seen []float64
	for _, s := range p.Series {
		xs := xsOf(s)
		for i := range min(len(xs), len(s.Y)) {
			if ok(xs[i], s.Y[i]) {
				seen = append(seen, xs[i])
			}
		}
	}
	if len(seen) == 0 {
		return
	}
	slices.Sort(seen)
	seen = slices.Compact(seen)
	tx := func(x float64) float64 { return x }
	if p.LogX {
		tx = math.Log10
	}
	xmin, xmax := tx(seen[0]), tx(seen[len(seen)-1])
	if xmax == xmin {
		xmin, xmax = xmin-0.5, xmax+0.5
	}
	if p.LogX { // a margin, so the end points stand clear of the axes
		pad := (xmax - xmin) * 0.05
		xmin, xmax = xmin-pad, xmax+pad
	}
	xPix := func(x float64) int {
		return area.Min.X + int(math.Round((tx(x)-xmin)/(xmax-xmin)*float64(area.Dx())))
	}
	ticks := p.XTicks
	switch {
	case ticks != nil:
	case p.LogX:
		ticks = seen
	default:
		lo, hi := seen[0], seen[len(seen)-1]
		ticks = []float64{lo, (lo + hi) / 2, hi}
	}
	label := p.XTickLabel
	if label == nil {
		label = short
	}
	for _, x := range ticks {
		if !usable(x, p.LogX) || tx(x) < xmin || tx(x) > xmax {
			continue
		}
		if p.LogX {
			vline(img, xPix(x), area.Min.Y, area.Max.Y, grey)
		}
		l := label(x)
		drawText(img, xPix(x)-textWidth(l, scale)/2, area.Max.Y+8, scale, black, l)
	}
	for si, s := range p.Series {
		c := colorOf(s, si)
		xs := xsOf(s)
		prev := image.Point{-1, -1}
		for i := range min(len(xs), len(s.Y)) {
			if !ok(xs[i], s.Y[i]) {
				continue
			}
			x, y := xPix(xs[i]), yPix(s.Y[i])
			fillRect(img, image.Rect(x-3, y-3, x+4, y+4), c)
			if prev.X >= 0 {
				line(img, prev.X, prev.Y, x, y, c, s.Dashed)
			}
			prev = image.Point{x, y}
		}
	}
}

// niceScale returns an axis top >= v and a tick step of 1, 2 or 5 x 10^k.
func niceScale(v float64) (top, step float64) {
	if v <= 0 {
		return 1, 0.25
	}
	raw := v / 5
	mag := math.Pow(10, math.Floor(math.Log10(raw)))
	for _, m := range []float64{1, 2, 5, 10} {
		step = m * mag
		if step >= raw {
			break
		}
	}
	return math.Ceil(v/step-1e-9) * step, step
}

// short formats a tick value compactly (1.5, 20, 300, 4K, 2.5M).
func short(v float64) string {
	a := math.Abs(v)
	switch {
	case a >= 1e9:
		return trim(v/1e9) + "G"
	case a >= 1e6:
		return trim(v/1e6) + "M"
	case a >= 1e4:
		return trim(v/1e3) + "K"
	}
	if a > 0 && a < 0.001 {
		return strconv.FormatFloat(v, 'g', 2, 64) // 1e-05
	}
	return trim(v)
}

// round3 keeps about three significant digits of a value written on a bar.
func round3(v float64) float64 {
	if v == 0 || math.IsNaN(v) || math.IsInf(v, 0) {
		return v
	}
	p := math.Pow(10, 2-math.Floor(math.Log10(math.Abs(v))))
	return math.Round(v*p) / p
}

func trim(v float64) string {
	s := strconv.FormatFloat(v, 'f', 3, 64)
	s = strings.TrimRight(strings.TrimRight(s, "0"), ".")
	if s == "-0" {
		return "0"
	}
	return s
}

func textWidth(s string, px int) int { return len([]rune(s)) * 4 * px }

func drawText(img *image.RGBA, x, y, px int, c color.RGBA, s string) {
	for _, r := range strings.ToUpper(s) {
		g := glyph(r)
		for i := 0; i < 5; i++ {
			for j := 0; j < 3; j++ {
				if g[i][j] {
					fillRect(img, image.Rect(x+j*px, y+i*px, x+(j+1)*px, y+(i+1)*px), c)
				}
			}
		}
		x += 4 * px
	}
}

func fillRect(img *image.RGBA, r image.Rectangle, c color.RGBA) {
	r = r.Canon().Intersect(img.Bounds())
	for y := r.Min.Y; y < r.Max.Y; y++ {
		for x := r.Min.X; x < r.Max.X; x++ {
			img.SetRGBA(x, y, c)
		}
	}
}

func hline(img *image.RGBA, x0, x1, y int, c color.RGBA) {
	fillRect(img, image.Rect(x0, y, x1+1, y+1), c)
}

func vline(img *image.RGBA, x, y0, y1 int, c color.RGBA) {
	fillRect(img, image.Rect(x, y0, x+1, y1+1), c)
}

// line draws a 2-pixel line (Bresenham), dashed on request.
func line(img *image.RGBA, x0, y0, x1, y1 int, c color.RGBA, dashed bool) {
	dx, dy := abs(x1-x0), -abs(y1-y0)
	sx, sy := sign(x1-x0), sign(y1-y0)
	e := dx + dy
	for n := 0; ; n++ {
		if !dashed || (n/6)%2 == 0 {
			fillRect(img, image.Rect(x0, y0, x0+2, y0+2), c)
		}
		if x0 == x1 && y0 == y1 {
			return
		}
		if e2 := 2 * e; e2 >= dy {
			e += dy
			x0 += sx
		} else {
			e += dx
			y0 += sy
		}
	}
}

func abs(a int) int {
	if a < 0 {
		return -a
	}
	return a
}

func sign(a int) int {
	switch {
	case a < 0:
		return -1
	case a > 0:
		return 1
	}
	return 0
}

// String is for debugging a panel's scale.
func (p Panel) String() string { return fmt.Sprintf("panel %q (%d series)", p.Title, len(p.Series)) }
