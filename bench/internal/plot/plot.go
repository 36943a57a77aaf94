// Package plot draws the benchmarks' charts as PNG with gonum.org/v1/plot:
// panels side by side under one title, each a line chart (X/Y series, linear
// or logarithmic axes) or a grouped bar chart (categories), with error bars
// where a series has a spread (repeated runs, many forks at once), axes that
// span the data and a legend of the series that have data. The CSV next to
// the PNG holds the exact figures.
package plot

import (
	"fmt"
	"image/color"
	"io"
	"math"
	"strconv"

	"gonum.org/v1/plot"
	"gonum.org/v1/plot/font"
	"gonum.org/v1/plot/plotter"
	"gonum.org/v1/plot/text"
	"gonum.org/v1/plot/vg"
	"gonum.org/v1/plot/vg/draw"
	"gonum.org/v1/plot/vg/vgimg"

	"github.com/lazyfork/lazyfork/bench/internal/report"
)

// Series is one line (or one bar per category).
type Series struct {
	Name string
	X    []float64 // line charts only; nil means 1, 2, 3...
	Y    []float64 // NaN: no point (or no bar)
	// Lo and Hi, when set (same length as Y), are the spread of each point
	// (e.g. min and max over the runs, or the median and max over forks),
	// drawn as an error bar; NaN where a point has none.
	Lo, Hi []float64
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

	// LogX and LogY make a line chart's axes logarithmic; points that are
	// not positive on a log axis are left out.
	LogX, LogY bool
	// XTicks are the X values labelled on a line chart (nil: chosen from
	// the data); XTickLabel formats X ticks (nil: compact numbers).
	XTicks     []float64
	XTickLabel func(float64) string
	// BarValues writes each bar's value above it.
	BarValues bool
	// LegendBelow puts the legend under the chart, one series a line, for
	// long names; otherwise it sits top left inside the chart.
	LegendBelow bool
}

// Palette is the series colours, in order.
var Palette = []color.RGBA{
	{31, 100, 200, 255}, {210, 60, 40, 255}, {40, 150, 70, 255},
	{150, 100, 40, 255}, {130, 60, 170, 255}, {20, 150, 160, 255},
}

const dpi = 96

func init() {
	// gonum's default is Liberation Serif; sans reads better on charts.
	plot.DefaultFont.Variant = "Sans"
}

var (
	panelW     = 6.5 * vg.Inch
	panelH     = 4.6 * vg.Inch
	titleH     = 0.55 * vg.Inch
	legendLine = 0.2 * vg.Inch
)

// WritePNG renders the panels under a title and writes the PNG atomically.
func WritePNG(path, title string, panels ...Panel) error {
	c, err := Render(title, panels...)
	if err != nil {
		return fmt.Errorf("plot %s: %w", path, err)
	}
	return report.WriteFileAtomic(path, func(w io.Writer) error {
		_, err := vgimg.PngCanvas{Canvas: c}.WriteTo(w)
		return err
	})
}

// Render draws the panels side by side under title.
func Render(title string, panels ...Panel) (*vgimg.Canvas, error) {
	n := max(len(panels), 1)
	legendH := vg.Length(0)
	for _, p := range panels {
		if p.LegendBelow {
			legendH = max(legendH, legendLine*vg.Length(len(withData(p)))+0.15*vg.Inch)
		}
	}
	w, h := panelW*vg.Length(n), titleH+panelH+legendH
	c := vgimg.NewWith(vgimg.UseWH(w, h), vgimg.UseDPI(dpi), vgimg.UseBackgroundColor(color.White))
	dc := draw.New(c)
	dc.FillText(textStyle(15, draw.XCenter), vg.Point{X: w / 2, Y: h - titleH/2 - 7}, title)
	for i, p := range panels {
		left, right := panelW*vg.Length(i), -panelW*vg.Length(n-1-i)
		pl, legend, err := build(p)
		if err != nil {
			return nil, fmt.Errorf("panel %q: %w", p.Title, err)
		}
		pl.Draw(draw.Crop(dc, left, right, legendH, -titleH))
		if legend != nil {
			legend.Draw(draw.Crop(dc, left+0.6*vg.Inch, right, 0, -(titleH + panelH)))
		}
	}
	return c, nil
}

func textStyle(size float64, align draw.XAlignment) text.Style {
	return text.Style{Color: color.Black, Font: font.From(plot.DefaultFont, vg.Length(size)),
		XAlign: align, YAlign: draw.YCenter, Handler: plot.DefaultTextHandler}
}

// withData lists the series that have at least one point to draw.
func withData(p Panel) []int {
	var out []int
	for i, s := range p.Series {
		if len(points(p, s)) > 0 {
			out = append(out, i)
		}
	}
	return out
}

type point struct{ x, y, lo, hi float64 }

// points are the drawable points of s in p.
func points(p Panel, s Series) []point {
	var out []point
	for i, y := range s.Y {
		x := float64(i + 1)
		if len(p.Categories) > 0 {
			x = float64(i)
		} else if s.X != nil {
			x = s.X[i]
		}
		if !finite(x) || !finite(y) || (p.LogX && x <= 0) || (p.LogY && y <= 0) {
			continue
		}
		pt := point{x, y, math.NaN(), math.NaN()}
		if s.Lo != nil && s.Hi != nil && finite(s.Lo[i]) && finite(s.Hi[i]) && (!p.LogY || s.Lo[i] > 0) {
			pt.lo, pt.hi = min(s.Lo[i], y), max(s.Hi[i], y)
		}
		out = append(out, pt)
	}
	return out
}

func finite(v float64) bool { return !math.IsNaN(v) && !math.IsInf(v, 0) }

func colorOf(s Series, i int) color.RGBA {
	if s.Color != (color.RGBA{}) {
		return s.Color
	}
	return Palette[i%len(Palette)]
}

// build makes the gonum plot of p, and the legend to draw below it if
// p.LegendBelow (else the legend is inside the plot).
func build(p Panel) (*plot.Plot, *plot.Legend, error) {
	pl := plot.New()
	pl.Title.Text = p.Title
	pl.Title.TextStyle.Font.Size = 13
	pl.X.Label.Text = p.XLabel
	pl.Y.Label.Text = p.YLabel
	pl.Add(plotter.NewGrid())
	legend := &pl.Legend
	if p.LegendBelow {
		l := plot.NewLegend()
		l.Top, l.Left = true, true
		l.Padding = vg.Points(2)
		legend = &l
	} else {
		pl.Legend.Top, pl.Legend.Left = true, true
		pl.Legend.Padding = vg.Points(2)
	}
	p = singleX(p)
	var err error
	if len(p.Categories) > 0 {
		err = bars(pl, legend, p)
	} else {
		err = lines(pl, legend, p)
	}
	if err != nil {
		return nil, nil, err
	}
	if p.LegendBelow {
		return pl, legend, nil
	}
	return pl, nil, nil
}

// singleX turns a line chart whose points all share one X (a run at one
// size) into bars in one category named after that X: lines of single dots
// say nothing.
func singleX(p Panel) Panel {
	if len(p.Categories) > 0 {
		return p
	}
	x, n := math.NaN(), 0
	for _, s := range p.Series {
		for _, pt := range points(p, s) {
			if n > 0 && pt.x != x {
				return p
			}
			x, n = pt.x, n+1
		}
	}
	if n == 0 {
		return p
	}
	label := p.XTickLabel
	if label == nil {
		label = Compact
	}
	q := p
	q.Categories = []string{label(x)}
	q.Series = nil
	for _, s := range p.Series {
		b := Series{Name: s.Name, Color: s.Color, Dashed: s.Dashed, Y: []float64{math.NaN()}}
		if pts := points(p, s); len(pts) > 0 {
			b.Y[0] = pts[0].y
			b.Lo, b.Hi = []float64{pts[0].lo}, []float64{pts[0].hi}
		}
		q.Series = append(q.Series, b)
	}
	q.LogX, q.LogY, q.BarValues = false, false, true
	return q
}

func lineStyle(s Series, i int) draw.LineStyle {
	ls := draw.LineStyle{Color: colorOf(s, i), Width: vg.Points(1.6)}
	if s.Dashed {
		ls.Dashes = []vg.Length{vg.Points(6), vg.Points(3)}
	}
	return ls
}

func lines(pl *plot.Plot, legend *plot.Legend, p Panel) error {
	var lo, hi [2]float64 // data range of x and y
	lo[0], lo[1], hi[0], hi[1] = math.Inf(1), math.Inf(1), math.Inf(-1), math.Inf(-1)
	var xs []float64
	for i, s := range p.Series {
		pts := points(p, s)
		if len(pts) == 0 {
			continue // no legend entry without data
		}
		xys := make(plotter.XYs, len(pts))
		var errs []point
		for j, pt := range pts {
			xys[j].X, xys[j].Y = pt.x, pt.y
			lo[0], hi[0] = min(lo[0], pt.x), max(hi[0], pt.x)
			lo[1], hi[1] = min(lo[1], pt.y), max(hi[1], pt.y)
			if finite(pt.lo) {
				errs = append(errs, pt)
				lo[1], hi[1] = min(lo[1], pt.lo), max(hi[1], pt.hi)
			}
			xs = append(xs, pt.x)
		}
		line, scatter, err := plotter.NewLinePoints(xys)
		if err != nil {
			return err
		}
		line.LineStyle = lineStyle(s, i)
		scatter.GlyphStyle = draw.GlyphStyle{Color: colorOf(s, i), Radius: vg.Points(3), Shape: draw.CircleGlyph{}}
		pl.Add(line, scatter)
		thumbs := []plot.Thumbnailer{line, scatter}
		if len(errs) > 0 {
			eb, err := errorBars(errs, colorOf(s, i))
			if err != nil {
				return err
			}
			pl.Add(eb)
		}
		legend.Add(s.Name, thumbs...)
	}
	if math.IsInf(lo[0], 1) {
		return nil // nothing to draw: empty axes
	}
	fit(&pl.X, lo[0], hi[0], p.LogX)
	fit(&pl.Y, lo[1], hi[1], p.LogY)
	label := p.XTickLabel
	if label == nil {
		label = Compact
	}
	switch {
	case p.XTicks != nil:
		pl.X.Tick.Marker = constTicks(p.XTicks, label)
	case p.LogX:
		pl.X.Tick.Marker = logTicks(label)
	case p.XTickLabel != nil:
		pl.X.Tick.Marker = relabel(plot.DefaultTicks{}, label)
	}
	if p.LogY {
		pl.Y.Tick.Marker = logTicks(Compact)
	} else {
		pl.Y.Tick.Marker = relabel(plot.DefaultTicks{}, Compact)
	}
	return nil
}

// fit sets an axis's range to the data with a margin, so that no point sits
// on the frame (a single value gets a range around it).
func fit(a *plot.Axis, lo, hi float64, log bool) {
	if log {
		a.Scale = plot.LogScale{}
		f := math.Pow(hi/lo, 0.06)
		f = max(f, 1.25)
		a.Min, a.Max = lo/f, hi*f
		return
	}
	d := (hi - lo) * 0.06
	if d == 0 {
		d = math.Max(math.Abs(hi)*0.1, 1)
	}
	a.Min, a.Max = lo-d, hi+d
	if lo >= 0 && a.Min < 0 {
		a.Min = 0
	}
}

func errorBars(pts []point, c color.RGBA) (*plotter.YErrorBars, error) {
	v := struct {
		plotter.XYs
		plotter.YErrors
	}{}
	for _, pt := range pts {
		v.XYs = append(v.XYs, plotter.XY{X: pt.x, Y: pt.y})
		v.YErrors = append(v.YErrors, struct{ Low, High float64 }{pt.y - pt.lo, pt.hi - pt.y})
	}
	eb, err := plotter.NewYErrorBars(v)
	if err != nil {
		return nil, err
	}
	eb.LineStyle = draw.LineStyle{Color: c, Width: vg.Points(1.2)}
	eb.CapWidth = vg.Points(7)
	return eb, nil
}

func bars(pl *plot.Plot, legend *plot.Legend, p Panel) error {
	idx := withData(p)
	nc, ns := len(p.Categories), max(len(idx), 1)
	// The data area is about the panel less the axis labels.
	catW := (panelW - 1.1*vg.Inch) / vg.Length(nc)
	barW := min(catW*0.8/vg.Length(ns), 0.9*vg.Inch)
	top := 0.0
	for k, i := range idx {
		s := p.Series[i]
		vals := make(plotter.Values, nc)
		for j := range vals {
			if j < len(s.Y) && finite(s.Y[j]) {
				vals[j] = s.Y[j]
			}
		}
		b, err := plotter.NewBarChart(vals, barW)
		if err != nil {
			return err
		}
		b.Color = colorOf(s, i)
		if s.Dashed { // a bar cannot be dashed: a lighter shade of its colour
			c := colorOf(s, i)
			b.Color = color.RGBA{R: c.R/2 + 128, G: c.G/2 + 128, B: c.B/2 + 128, A: 255}
		}
		b.LineStyle.Width = 0
		b.Offset = barW * (vg.Length(k) - vg.Length(ns-1)/2)
		pl.Add(b)
		legend.Add(s.Name, b)
		var errs []point
		for _, pt := range points(p, s) {
			top = max(top, pt.y)
			if finite(pt.lo) {
				errs = append(errs, pt)
				top = max(top, pt.hi)
			}
		}
		if len(errs) > 0 {
			eb, err := errorBars(errs, color.RGBA{A: 255})
			if err != nil {
				return err
			}
			pl.Add(shifted{eb, b.Offset})
		}
		if p.BarValues {
			var xyl plotter.XYLabels
			for _, pt := range points(p, s) {
				y := pt.y
				if finite(pt.hi) { // above the error bar
					y = pt.hi
				}
				xyl.XYs = append(xyl.XYs, plotter.XY{X: pt.x, Y: y})
				xyl.Labels = append(xyl.Labels, Compact(pt.y))
			}
			if len(xyl.Labels) > 0 {
				l, err := plotter.NewLabels(xyl)
				if err != nil {
					return err
				}
				for j := range l.TextStyle {
					l.TextStyle[j].XAlign = draw.XCenter
					l.TextStyle[j].Font = font.From(plot.DefaultFont, 8)
				}
				l.Offset = vg.Point{X: b.Offset, Y: vg.Points(7)}
				pl.Add(l)
			}
		}
	}
	pl.NominalX(p.Categories...)
	pl.X.Min, pl.X.Max = -0.5, float64(nc)-0.5
	pl.Y.Min, pl.Y.Max = 0, top*1.12
	if top == 0 {
		pl.Y.Max = 1
	}
	pl.Y.Tick.Marker = relabel(plot.DefaultTicks{}, Compact)
	return nil
}

// shifted draws a plotter moved right by dx, as a bar chart's Offset moves
// its bars.
type shifted struct {
	*plotter.YErrorBars
	dx vg.Length
}

func (s shifted) Plot(c draw.Canvas, p *plot.Plot) {
	c.Translate(vg.Point{X: s.dx})
	s.YErrorBars.Plot(c, p)
	c.Translate(vg.Point{X: -s.dx})
}

func relabel(t plot.Ticker, label func(float64) string) plot.Ticker {
	return plot.TickerFunc(func(min, max float64) []plot.Tick {
		ts := t.Ticks(min, max)
		for i := range ts {
			if ts[i].Label != "" {
				ts[i].Label = label(ts[i].Value)
			}
		}
		return ts
	})
}

func constTicks(xs []float64, label func(float64) string) plot.Ticker {
	var ts plot.ConstantTicks
	for _, x := range xs {
		ts = append(ts, plot.Tick{Value: x, Label: label(x)})
	}
	return ts
}

// logTicks labels 1, 2 and 5 times the powers of ten inside the range (every
// integer multiple when that leaves fewer than three, linear ticks when even
// that does), with minor ticks at the other multiples.
func logTicks(label func(float64) string) plot.Ticker {
	return plot.TickerFunc(func(lo, hi float64) []plot.Tick {
		var ts []plot.Tick
		for _, majors := range [][]int{{1}, {1, 2, 5}, {1, 2, 3, 4, 5, 6, 7, 8, 9}} {
			ts = ts[:0]
			labelled := 0
			for e := math.Floor(math.Log10(lo)); e <= math.Ceil(math.Log10(hi)); e++ {
				for m := 1; m <= 9; m++ {
					v := float64(m) * math.Pow(10, e)
					if v < lo || v > hi {
						continue
					}
					t := plot.Tick{Value: v}
					for _, mm := range majors {
						if m == mm {
							t.Label = label(v)
							labelled++
						}
					}
					ts = append(ts, t)
				}
			}
			if labelled >= 3 {
				return ts
			}
		}
		// Less than a decade or so: linear ticks read better.
		return relabel(plot.DefaultTicks{}, label).Ticks(lo, hi)
	})
}

// Compact formats a tick value briefly: 0.002, 1.5, 250, 12k, 3M.
func Compact(v float64) string {
	a := math.Abs(v)
	switch {
	case a == 0:
		return "0"
	case a >= 1e9:
		return strconv.FormatFloat(v/1e9, 'g', 3, 64) + "G"
	case a >= 1e6:
		return strconv.FormatFloat(v/1e6, 'g', 3, 64) + "M"
	case a >= 1e4:
		return strconv.FormatFloat(v/1e3, 'g', 3, 64) + "k"
	case a >= 100:
		return strconv.FormatFloat(v, 'f', 0, 64)
	default:
		return strconv.FormatFloat(v, 'g', 3, 64)
	}
}
