package main

import (
	"fmt"
	"image"
	"image/color"
	"image/png"
	"math"
	"os"
	"strings"
)

// A hand-drawn PNG: two log-log panels (restore time per copy; memory per copy)
// against heap size, with a 3x5 pixel font scaled up. No plotting module needed.

type series struct {
	name  string
	col   color.RGBA
	dash  bool
	xs    []float64
	ys    []float64
	label string
}

var (
	white = color.RGBA{255, 255, 255, 255}
	black = color.RGBA{0, 0, 0, 255}
	grey  = color.RGBA{215, 215, 215, 255}
	blue  = color.RGBA{31, 100, 200, 255}
	red   = color.RGBA{210, 60, 40, 255}
	green = color.RGBA{40, 150, 70, 255}
	brown = color.RGBA{150, 100, 40, 255}
)

func writePlot(path string, rows []row) error {
	var heaps []float64
	for _, r := range rows {
		if r.Mode == "memfile" {
			heaps = append(heaps, float64(r.HeapMiB))
		}
	}
	pick := func(mode string, f func(r row) float64) []float64 {
		var ys []float64
		for _, r := range rows {
			if r.Mode == mode {
				ys = append(ys, f(r))
			}
		}
		return ys
	}
	msOf := func(r row) float64 { return float64(r.Restore1.Microseconds()) / 1000 }
	msOf10 := func(r row) float64 { return float64(r.Restore10Mean.Microseconds()) / 1000 }
	mib := func(b int64) float64 { return float64(b) / (1 << 20) }

	img := image.NewRGBA(image.Rect(0, 0, 1400, 700))
	fill(img, img.Bounds(), white)
	text(img, 20, 14, 3, black, "LAZYFORK MEMFILE RESTORE VS PLAIN CRIU RESTORE (C GLIBC WORKLOAD)")
	panel(img, image.Rect(90, 70, 660, 540), "RESTORE TIME PER COPY (MS)", "HEAP (MIB)", heaps, []series{
		{name: "MEMFILE, 1 COPY", col: blue, xs: heaps, ys: pick("memfile", msOf)},
		{name: "MEMFILE, 10 AT ONCE (MEAN)", col: blue, dash: true, xs: heaps, ys: pick("memfile", msOf10)},
		{name: "PLAIN, 1 COPY", col: red, xs: heaps, ys: pick("plain", msOf)},
		{name: "PLAIN, 10 AT ONCE (MEAN)", col: red, dash: true, xs: heaps, ys: pick("plain", msOf10)},
	})
	panel(img, image.Rect(790, 70, 1360, 540), "MEMORY PER COPY (MIB)", "HEAP (MIB)", heaps, []series{
		{name: "MEMFILE RSSANON AFTER RESTORE", col: blue, xs: heaps, ys: pick("memfile", func(r row) float64 { return mib(r.After.RssAnon) })},
		{name: "MEMFILE PSS AFTER 5 S", col: green, xs: heaps, ys: pick("memfile", func(r row) float64 { return mib(r.After5s.Pss) })},
		{name: "MEMFILE RSSSHMEM AFTER 5 S", col: brown, dash: true, xs: heaps, ys: pick("memfile", func(r row) float64 { return mib(r.After5s.RssShmem) })},
		{name: "PLAIN RSSANON AFTER RESTORE", col: red, xs: heaps, ys: pick("plain", func(r row) float64 { return mib(r.After.RssAnon) })},
	})
	tmp := path + ".tmp"
	f, err := os.Create(tmp)
	if err != nil {
		return err
	}
	if err := png.Encode(f, img); err != nil {
		f.Close()
		return err
	}
	if err := f.Close(); err != nil {
		return err
	}
	return os.Rename(tmp, path)
}

// panel draws a log-log chart of the series inside r, legend below.
func panel(img *image.RGBA, r image.Rectangle, title, xlabel string, xticks []float64, ss []series) {
	text(img, r.Min.X, r.Min.Y-26, 2, black, title)
	lo, hi := math.Inf(1), math.Inf(-1)
	for _, s := range ss {
		for _, y := range s.ys {
			if y > 0 {
				lo, hi = math.Min(lo, y), math.Max(hi, y)
			}
		}
	}
	if math.IsInf(lo, 1) {
		lo, hi = 1, 10
	}
	ylo, yhi := math.Floor(math.Log10(lo)), math.Ceil(math.Log10(hi))
	if yhi == ylo {
		yhi++
	}
	xlo, xhi := math.Log2(xticks[0]), math.Log2(xticks[len(xticks)-1])
	if xhi == xlo {
		xhi++
	}
	px := func(x float64) int {
		return r.Min.X + int((math.Log2(x)-xlo)/(xhi-xlo)*float64(r.Dx()))
	}
	py := func(y float64) int {
		return r.Max.Y - int((math.Log10(y)-ylo)/(yhi-ylo)*float64(r.Dy()))
	}
	for e := ylo; e <= yhi; e++ {
		y := r.Max.Y - int((e-ylo)/(yhi-ylo)*float64(r.Dy()))
		hline(img, r.Min.X, r.Max.X, y, grey)
		lbl := fmt.Sprintf("%g", math.Pow(10, e))
		text(img, r.Min.X-8-len(lbl)*8, y-5, 2, black, lbl)
	}
	for _, x := range xticks {
		vline(img, px(x), r.Min.Y, r.Max.Y, grey)
		lbl := fmt.Sprintf("%g", x)
		text(img, px(x)-len(lbl)*4, r.Max.Y+8, 2, black, lbl)
	}
	hline(img, r.Min.X, r.Max.X, r.Max.Y, black)
	vline(img, r.Min.X, r.Min.Y, r.Max.Y, black)
	text(img, r.Max.X-len(xlabel)*8, r.Max.Y+26, 2, black, xlabel)
	for i, s := range ss {
		var prevX, prevY int
		for j := range s.xs {
			if j >= len(s.ys) || s.ys[j] <= 0 {
				continue
			}
			x, y := px(s.xs[j]), py(s.ys[j])
			fill(img, image.Rect(x-3, y-3, x+4, y+4), s.col)
			if j > 0 && prevX != 0 {
				line(img, prevX, prevY, x, y, s.col, s.dash)
			}
			prevX, prevY = x, y
		}
		ly := r.Max.Y + 48 + 16*i
		line(img, r.Min.X, ly+4, r.Min.X+30, ly+4, s.col, s.dash)
		text(img, r.Min.X+40, ly, 2, black, s.name)
	}
}

func fill(img *image.RGBA, r image.Rectangle, c color.RGBA) {
	for y := r.Min.Y; y < r.Max.Y; y++ {
		for x := r.Min.X; x < r.Max.X; x++ {
			img.SetRGBA(x, y, c)
		}
	}
}

func hline(img *image.RGBA, x0, x1, y int, c color.RGBA) {
	for x := x0; x <= x1; x++ {
		img.SetRGBA(x, y, c)
	}
}

func vline(img *image.RGBA, x, y0, y1 int, c color.RGBA) {
	for y := y0; y <= y1; y++ {
		img.SetRGBA(x, y, c)
	}
}

// line draws a 2-pixel-thick segment, dashed if asked.
func line(img *image.RGBA, x0, y0, x1, y1 int, c color.RGBA, dash bool) {
	n := max(abs(x1-x0), abs(y1-y0))
	if n == 0 {
		return
	}
	for i := 0; i <= n; i++ {
		if dash && (i/8)%2 == 1 {
			continue
		}
		x := x0 + (x1-x0)*i/n
		y := y0 + (y1-y0)*i/n
		img.SetRGBA(x, y, c)
		img.SetRGBA(x, y+1, c)
		img.SetRGBA(x+1, y, c)
	}
}

func abs(x int) int {
	if x < 0 {
		return -x
	}
	return x
}

// text draws s with the 3x5 font, each font pixel scale x scale.
func text(img *image.RGBA, x, y, scale int, c color.RGBA, s string) {
	for _, r := range strings.ToUpper(s) {
		g, ok := font[r]
		if !ok {
			g = font['?']
		}
		for row := 0; row < 5; row++ {
			for col := 0; col < 3; col++ {
				if g[row][col] == '#' {
					fill(img, image.Rect(x+col*scale, y+row*scale, x+(col+1)*scale, y+(row+1)*scale), c)
				}
			}
		}
		x += 4 * scale
	}
}

var font = map[rune][5]string{
	'A': {".#.", "#.#", "###", "#.#", "#.#"}, 'B': {"##.", "#.#", "##.", "#.#", "##."},
	'C': {".##", "#..", "#..", "#..", ".##"}, 'D': {"##.", "#.#", "#.#", "#.#", "##."},
	'E': {"###", "#..", "##.", "#..", "###"}, 'F': {"###", "#..", "##.", "#..", "#.."},
	'G': {".##", "#..", "#.#", "#.#", ".##"}, 'H': {"#.#", "#.#", "###", "#.#", "#.#"},
	'I': {"###", ".#.", ".#.", ".#.", "###"}, 'J': {"..#", "..#", "..#", "#.#", ".#."},
	'K': {"#.#", "#.#", "##.", "#.#", "#.#"}, 'L': {"#..", "#..", "#..", "#..", "###"},
	'M': {"#.#", "###", "###", "#.#", "#.#"}, 'N': {"##.", "#.#", "#.#", "#.#", "#.#"},
	'O': {".#.", "#.#", "#.#", "#.#", ".#."}, 'P': {"##.", "#.#", "##.", "#..", "#.."},
	'Q': {".#.", "#.#", "#.#", "##.", ".##"}, 'R': {"##.", "#.#", "##.", "#.#", "#.#"},
	'S': {".##", "#..", ".#.", "..#", "##."}, 'T': {"###", ".#.", ".#.", ".#.", ".#."},
	'U': {"#.#", "#.#", "#.#", "#.#", "###"}, 'V': {"#.#", "#.#", "#.#", "#.#", ".#."},
	'W': {"#.#", "#.#", "###", "###", "#.#"}, 'X': {"#.#", "#.#", ".#.", "#.#", "#.#"},
	'Y': {"#.#", "#.#", ".#.", ".#.", ".#."}, 'Z': {"###", "..#", ".#.", "#..", "###"},
	'0': {"###", "#.#", "#.#", "#.#", "###"}, '1': {".#.", "##.", ".#.", ".#.", "###"},
	'2': {"##.", "..#", ".#.", "#..", "###"}, '3': {"##.", "..#", ".#.", "..#", "##."},
	'4': {"#.#", "#.#", "###", "..#", "..#"}, '5': {"###", "#..", "##.", "..#", "##."},
	'6': {".##", "#..", "###", "#.#", "###"}, '7': {"###", "..#", ".#.", ".#.", ".#."},
	'8': {"###", "#.#", "###", "#.#", "###"}, '9': {"###", "#.#", "###", "..#", "##."},
	' ': {"...", "...", "...", "...", "..."}, '.': {"...", "...", "...", "...", ".#."},
	',': {"...", "...", "...", ".#.", "#.."}, '(': {"..#", ".#.", ".#.", ".#.", "..#"},
	')': {"#..", ".#.", ".#.", ".#.", "#.."}, '-': {"...", "...", "###", "...", "..."},
	'+': {"...", ".#.", "###", ".#.", "..."}, '/': {"..#", "..#", ".#.", "#..", "#.."},
	':': {"...", ".#.", "...", ".#.", "..."}, '?': {"##.", "..#", ".#.", "...", ".#."},
}
