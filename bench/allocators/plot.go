package main

import (
	"fmt"
	"image"
	"image/color"
	"image/png"
	"os"
	"strings"
)

// plot draws, per allocator, the parent's RssAnon beside the mean RssAnon of
// its forks in each mode: a grouped bar chart with a y grid, labels in a
// built-in 3x5 pixel font.
func plot(path string, rows []row) error {
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
	series := []string{"PARENT", "FORK unguarded", "FORK refuse", "FORK zero"}
	colors := []color.RGBA{{90, 90, 90, 255}, {214, 39, 40, 255}, {31, 119, 180, 255}, {44, 160, 44, 255}}
	top := 1.0
	for k, v := range sum {
		top = max(top, v/float64(n[k]))
	}
	step := niceStep(top / 5)
	top = step * float64(int(top/step)+1)

	const W, H, left, right, bottom, topPad = 900, 480, 70, 20, 60, 60
	img := image.NewRGBA(image.Rect(0, 0, W, H))
	fill(img, 0, 0, W, H, color.RGBA{255, 255, 255, 255})
	plotH := H - bottom - topPad
	y := func(v float64) int { return H - bottom - int(v/top*float64(plotH)) }
	for v := 0.0; v <= top+step/2; v += step {
		fill(img, left, y(v), W-right, y(v)+1, color.RGBA{220, 220, 220, 255})
		text(img, left-8-textWidth(fmt.Sprintf("%.0f", v), 2), y(v)-5, fmt.Sprintf("%.0f", v), 2, color.RGBA{0, 0, 0, 255})
	}
	text(img, 10, 12, "RSSANON MIB AFTER CHURN: PARENT AND MEAN FORK PER MODE", 2, color.RGBA{0, 0, 0, 255})
	groupW := (W - left - right) / max(len(allocs), 1)
	barW := groupW / (len(series) + 1)
	for gi, a := range allocs {
		x0 := left + gi*groupW + barW/2
		for si, s := range series {
			k := key{a, s}
			if n[k] == 0 {
				continue
			}
			v := sum[k] / float64(n[k])
			x := x0 + si*barW
			fill(img, x, y(v), x+barW-3, H-bottom, colors[si])
			lbl := fmt.Sprintf("%.0f", v)
			text(img, x+(barW-3-textWidth(lbl, 1))/2, y(v)-8, lbl, 1, color.RGBA{0, 0, 0, 255})
		}
		text(img, left+gi*groupW+(groupW-textWidth(a, 2))/2, H-bottom+10, a, 2, color.RGBA{0, 0, 0, 255})
	}
	fill(img, left, H-bottom, W-right, H-bottom+1, color.RGBA{0, 0, 0, 255})
	lx := left
	for si, s := range series {
		fill(img, lx, 36, lx+12, 48, colors[si])
		text(img, lx+16, 38, s, 2, color.RGBA{0, 0, 0, 255})
		lx += 16 + textWidth(s, 2) + 24
	}
	f, err := os.Create(path + ".tmp")
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
	return os.Rename(path+".tmp", path)
}

func niceStep(raw float64) float64 {
	for _, s := range []float64{1, 2, 5, 10, 20, 25, 50, 100, 200, 250, 500, 1000, 2000, 5000} {
		if s >= raw {
			return s
		}
	}
	return 10000
}

func fill(img *image.RGBA, x0, y0, x1, y1 int, c color.RGBA) {
	for y := max(y0, 0); y < y1 && y < img.Rect.Dy(); y++ {
		for x := max(x0, 0); x < x1 && x < img.Rect.Dx(); x++ {
			img.SetRGBA(x, y, c)
		}
	}
}

// glyphs: 3x5 pixels, rows top to bottom, 3 bits each (MSB left).
var glyphs = map[rune][5]uint8{
	'A': {2, 5, 7, 5, 5}, 'B': {6, 5, 6, 5, 6}, 'C': {3, 4, 4, 4, 3}, 'D': {6, 5, 5, 5, 6},
	'E': {7, 4, 6, 4, 7}, 'F': {7, 4, 6, 4, 4}, 'G': {3, 4, 5, 5, 3}, 'H': {5, 5, 7, 5, 5},
	'I': {7, 2, 2, 2, 7}, 'J': {1, 1, 1, 5, 2}, 'K': {5, 5, 6, 5, 5}, 'L': {4, 4, 4, 4, 7},
	'M': {5, 7, 7, 5, 5}, 'N': {6, 5, 5, 5, 5}, 'O': {2, 5, 5, 5, 2}, 'P': {6, 5, 6, 4, 4},
	'Q': {2, 5, 5, 6, 3}, 'R': {6, 5, 6, 5, 5}, 'S': {3, 4, 2, 1, 6}, 'T': {7, 2, 2, 2, 2},
	'U': {5, 5, 5, 5, 7}, 'V': {5, 5, 5, 5, 2}, 'W': {5, 5, 7, 7, 5}, 'X': {5, 5, 2, 5, 5},
	'Y': {5, 5, 2, 2, 2}, 'Z': {7, 1, 2, 4, 7},
	'0': {7, 5, 5, 5, 7}, '1': {2, 6, 2, 2, 7}, '2': {6, 1, 2, 4, 7}, '3': {6, 1, 2, 1, 6},
	'4': {5, 5, 7, 1, 1}, '5': {7, 4, 6, 1, 6}, '6': {3, 4, 7, 5, 7}, '7': {7, 1, 2, 2, 2},
	'8': {7, 5, 7, 5, 7}, '9': {7, 5, 7, 1, 6},
	'-': {0, 0, 7, 0, 0}, '.': {0, 0, 0, 0, 2}, ':': {0, 2, 0, 2, 0}, ' ': {0, 0, 0, 0, 0},
}

func textWidth(s string, scale int) int { return len(s) * 4 * scale }

func text(img *image.RGBA, x, y int, s string, scale int, c color.RGBA) {
	for i, r := range strings.ToUpper(s) {
		g, ok := glyphs[r]
		if !ok {
			continue
		}
		for row := 0; row < 5; row++ {
			for col := 0; col < 3; col++ {
				if g[row]&(4>>col) != 0 {
					px, py := x+(i*4+col)*scale, y+row*scale
					fill(img, px, py, px+scale, py+scale, c)
				}
			}
		}
	}
}
