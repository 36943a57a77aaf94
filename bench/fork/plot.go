package main

import (
	"fmt"
	"image"
	"image/color"
	"image/png"
	"math"
	"os"
	"path/filepath"
	"strings"
)

// A small hand-drawn PNG (no plotting module): log-log panels against heap size,
// labelled with a 3x5 pixel font.

type line struct {
	name   string
	col    color.RGBA
	dashed bool
	xs, ys []float64
}

var (
	cWhite = color.RGBA{255, 255, 255, 255}
	cBlack = color.RGBA{20, 20, 20, 255}
	cGrid  = color.RGBA{220, 220, 220, 255}
	cLF    = color.RGBA{30, 110, 200, 255}
	cLF2   = color.RGBA{40, 160, 80, 255}
	cPlain = color.RGBA{205, 60, 40, 255}
	cShim  = color.RGBA{150, 100, 40, 255}
)

func writePlot(path string, heaps []int, r *results) error {
	xs := make([]float64, len(heaps))
	for i, h := range heaps {
		xs[i] = float64(h)
	}
	series := func(system, metric string, scale float64) ([]float64, []float64) {
		var x, y []float64
		for _, h := range heaps {
			if v, ok := r.get(h, system, metric); ok && v > 0 {
				x = append(x, float64(h))
				y = append(y, v*scale)
			}
		}
		return x, y
	}
	mk := func(name string, col color.RGBA, dashed bool, system, metric string, scale float64) line {
		x, y := series(system, metric, scale)
		return line{name: name, col: col, dashed: dashed, xs: x, ys: y}
	}
	img := image.NewRGBA(image.Rect(0, 0, 1500, 640))
	fillRect(img, img.Bounds(), cWhite)
	drawText(img, 20, 12, 3, cBlack, "LAZYFORK FORK VS PLAIN RUNC CHECKPOINT/RESTORE, PYTHON COUNTER")
	panel(img, image.Rect(90, 80, 500, 440), "RESTORE PER FORK (MS)", xs, []line{
		mk("LAZYFORK 1 FORK", cLF, false, "lazyfork", "restore_1", 1000),
		mk("LAZYFORK 10 AT ONCE (MEDIAN)", cLF, true, "lazyfork", "restore_10_median", 1000),
		mk("PLAIN 1 COPY", cPlain, false, "plain", "restore_1", 1000),
		mk("PLAIN 10 AT ONCE (MEDIAN)", cPlain, true, "plain", "restore_10_median", 1000),
		mk("FORK OF A FORK", cLF2, false, "lazyfork", "fork_of_fork_restore", 1000),
	})
	panel(img, image.Rect(590, 80, 1000, 440), "PARENT PAUSED FOR SNAPSHOT (MS)", xs, []line{
		mk("LAZYFORK DUMP+REWRITE", cLF, false, "lazyfork", "snapshot_pause", 1000),
		mk("PLAIN DUMP", cPlain, false, "plain", "snapshot_pause", 1000),
		mk("FORK OF A FORK", cLF2, false, "lazyfork", "fork_of_fork_pause", 1000),
	})
	panel(img, image.Rect(1080, 80, 1490, 440), "MEMORY PER FORK (MB)", xs, []line{
		mk("LAZYFORK AFTER RESTORE", cLF, false, "lazyfork", "memory_after_restore_median", 1e-6),
		mk("LAZYFORK AFTER 5 S", cLF, true, "lazyfork", "memory_after_5s_median", 1e-6),
		mk("SHIM RSS / FORKS", cShim, false, "lazyfork", "shim_rss_per_fork", 1e-6),
		mk("PLAIN AFTER RESTORE", cPlain, false, "plain", "memory_after_restore_1", 1e-6),
	})
	if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
		return err
	}
	f, err := os.CreateTemp(filepath.Dir(path), ".fork.png.tmp-")
	if err != nil {
		return err
	}
	defer os.Remove(f.Name())
	if err := png.Encode(f, img); err != nil {
		f.Close()
		return err
	}
	if err := f.Chmod(0o644); err != nil {
		f.Close()
		return err
	}
	if err := f.Close(); err != nil {
		return err
	}
	return os.Rename(f.Name(), path)
}

// panel draws a log2(x) / log10(y) chart inside r with its legend below.
func panel(img *image.RGBA, r image.Rectangle, title string, xticks []float64, ls []line) {
	drawText(img, r.Min.X-40, r.Min.Y-40, 2, cBlack, title)
	lo, hi := math.Inf(1), math.Inf(-1)
	for _, l := range ls {
		for _, y := range l.ys {
			lo, hi = math.Min(lo, y), math.Max(hi, y)
		}
	}
	if math.IsInf(lo, 1) {
		lo, hi = 1, 10
	}
	ylo, yhi := math.Floor(math.Log10(lo)), math.Ceil(math.Log10(hi))
	if yhi <= ylo {
		yhi = ylo + 1
	}
	xlo, xhi := math.Log2(xticks[0]), math.Log2(xticks[len(xticks)-1])
	if xhi <= xlo {
		xhi = xlo + 1
	}
	px := func(x float64) int { return r.Min.X + int((math.Log2(x)-xlo)/(xhi-xlo)*float64(r.Dx())) }
	py := func(y float64) int { return r.Max.Y - int((math.Log10(y)-ylo)/(yhi-ylo)*float64(r.Dy())) }
	for e := ylo; e <= yhi; e++ {
		y := py(math.Pow(10, e))
		drawLine(img, r.Min.X, y, r.Max.X, y, cGrid, false)
		lbl := fmt.Sprintf("%g", math.Pow(10, e))
		drawText(img, r.Min.X-10-len(lbl)*8, y-5, 2, cBlack, lbl)
	}
	for _, x := range xticks {
		X := px(x)
		drawLine(img, X, r.Min.Y, X, r.Max.Y, cGrid, false)
		lbl := fmt.Sprintf("%g", x)
		drawText(img, X-len(lbl)*4, r.Max.Y+8, 2, cBlack, lbl)
	}
	drawText(img, r.Max.X-80, r.Max.Y+24, 2, cBlack, "HEAP MIB")
	drawLine(img, r.Min.X, r.Max.Y, r.Max.X, r.Max.Y, cBlack, false)
	drawLine(img, r.Min.X, r.Min.Y, r.Min.X, r.Max.Y, cBlack, false)
	for i, l := range ls {
		for j := range l.xs {
			X, Y := px(l.xs[j]), py(l.ys[j])
			fillRect(img, image.Rect(X-3, Y-3, X+4, Y+4), l.col)
			if j > 0 {
				drawLine(img, px(l.xs[j-1]), py(l.ys[j-1]), X, Y, l.col, l.dashed)
			}
		}
		ly := r.Max.Y + 48 + i*16
		drawLine(img, r.Min.X-40, ly+5, r.Min.X-10, ly+5, l.col, l.dashed)
		drawText(img, r.Min.X, ly, 2, cBlack, l.name)
	}
}

func fillRect(img *image.RGBA, r image.Rectangle, c color.RGBA) {
	r = r.Intersect(img.Bounds())
	for y := r.Min.Y; y < r.Max.Y; y++ {
		for x := r.Min.X; x < r.Max.X; x++ {
			img.SetRGBA(x, y, c)
		}
	}
}

// drawLine draws a 2-pixel line (Bresenham), dashed on request.
func drawLine(img *image.RGBA, x0, y0, x1, y1 int, c color.RGBA, dashed bool) {
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

func abs(v int) int {
	if v < 0 {
		return -v
	}
	return v
}

func sign(v int) int {
	switch {
	case v < 0:
		return -1
	case v > 0:
		return 1
	}
	return 0
}

// glyphs is a 3x5 font: five rows of three pixels per character.
var glyphs = map[rune]string{
	'0': "###,#.#,#.#,#.#,###", '1': ".#.,##.,.#.,.#.,###", '2': "###,..#,###,#..,###",
	'3': "###,..#,.##,..#,###", '4': "#.#,#.#,###,..#,..#", '5': "###,#..,###,..#,###",
	'6': "###,#..,###,#.#,###", '7': "###,..#,.#.,.#.,.#.", '8': "###,#.#,###,#.#,###",
	'9': "###,#.#,###,..#,###", 'A': ".#.,#.#,###,#.#,#.#", 'B': "##.,#.#,##.,#.#,##.",
	'C': ".##,#..,#..,#..,.##", 'D': "##.,#.#,#.#,#.#,##.", 'E': "###,#..,##.,#..,###",
	'F': "###,#..,##.,#..,#..", 'G': ".##,#..,#.#,#.#,.##", 'H': "#.#,#.#,###,#.#,#.#",
	'I': "###,.#.,.#.,.#.,###", 'J': "..#,..#,..#,#.#,.#.", 'K': "#.#,#.#,##.,#.#,#.#",
	'L': "#..,#..,#..,#..,###", 'M': "#.#,###,###,#.#,#.#", 'N': "##.,#.#,#.#,#.#,#.#",
	'O': ".#.,#.#,#.#,#.#,.#.", 'P': "##.,#.#,##.,#..,#..", 'Q': ".#.,#.#,#.#,##.,.##",
	'R': "##.,#.#,##.,#.#,#.#", 'S': ".##,#..,.#.,..#,##.", 'T': "###,.#.,.#.,.#.,.#.",
	'U': "#.#,#.#,#.#,#.#,###", 'V': "#.#,#.#,#.#,#.#,.#.", 'W': "#.#,#.#,###,###,#.#",
	'X': "#.#,#.#,.#.,#.#,#.#", 'Y': "#.#,#.#,.#.,.#.,.#.", 'Z': "###,..#,.#.,#..,###",
	'.': "...,...,...,...,.#.", ',': "...,...,...,.#.,#..", '-': "...,...,###,...,...",
	'+': "...,.#.,###,.#.,...", '/': "..#,..#,.#.,#..,#..", '(': ".#.,#..,#..,#..,.#.",
	')': ".#.,..#,..#,..#,.#.", ':': "...,.#.,...,.#.,...", '%': "#.#,..#,.#.,#..,#.#",
	'e': "...,###,#..,##.,###", ' ': "...,...,...,...,...",
}

// drawText writes s at (x, y) with pixels of size scale.
func drawText(img *image.RGBA, x, y, scale int, c color.RGBA, s string) {
	for _, ch := range s {
		g, ok := glyphs[ch]
		if !ok {
			g = glyphs[rune(strings.ToUpper(string(ch))[0])]
		}
		for row, bits := range strings.Split(g, ",") {
			for col, b := range bits {
				if b == '#' {
					fillRect(img, image.Rect(x+col*scale, y+row*scale, x+(col+1)*scale, y+(row+1)*scale), c)
				}
			}
		}
		x += 4 * scale
	}
}
