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

// A small log-log line plot drawn by hand: no plotting modules.

type series struct {
	name string
	c    color.RGBA
	xs   []float64 // bytes
	ys   []float64 // seconds
}

func plotSeries(rs []result) []series {
	pick := func(name string, c color.RGBA, fs, method string, y func(result) float64) series {
		s := series{name: name, c: c}
		for _, r := range rs {
			if r.FS == fs && r.Method == method {
				s.xs = append(s.xs, float64(r.SizeBytes))
				s.ys = append(s.ys, y(r))
			}
		}
		return s
	}
	perFork := func(r result) float64 { return r.PerForkSec }
	pause := func(r result) float64 { return r.ParentPause }
	prep := func(r result) float64 { return r.PrepareSec }
	out := []series{
		pick("EXT4 COPY PER FORK", color.RGBA{200, 40, 40, 255}, "ext4", "copy-per-fork", perFork),
		pick("EXT4 FROZEN LAYER, TOTAL PER FORK", color.RGBA{30, 90, 200, 255}, "ext4", "frozen-layer", perFork),
		pick("EXT4 FROZEN LAYER, PARENT PAUSE", color.RGBA{30, 160, 60, 255}, "ext4", "frozen-layer", pause),
		pick("EXT4 PREPARE ON FROZEN LAYER", color.RGBA{120, 60, 160, 255}, "ext4", "frozen-layer", prep),
		pick("XFS FROZEN LAYER, TOTAL PER FORK", color.RGBA{230, 140, 20, 255}, "xfs", "frozen-layer", perFork),
	}
	var keep []series
	for _, s := range out {
		if len(s.xs) > 0 {
			keep = append(keep, s)
		}
	}
	return keep
}

func writePlot(path string, rs []result) error {
	ss := plotSeries(rs)
	const W, H = 760, 460
	const left, right, top, bottom = 70, 20, 30, 150
	img := image.NewRGBA(image.Rect(0, 0, W, H))
	for i := range img.Pix {
		img.Pix[i] = 255
	}
	minX, maxX, minY, maxY := math.Inf(1), math.Inf(-1), math.Inf(1), math.Inf(-1)
	for _, s := range ss {
		for i := range s.xs {
			minX, maxX = math.Min(minX, s.xs[i]), math.Max(maxX, s.xs[i])
			y := math.Max(s.ys[i], 1e-6)
			minY, maxY = math.Min(minY, y), math.Max(maxY, y)
		}
	}
	if len(ss) == 0 {
		return fmt.Errorf("nothing to plot")
	}
	lx0, lx1 := math.Floor(math.Log10(minX)), math.Ceil(math.Log10(maxX))
	ly0, ly1 := math.Floor(math.Log10(minY)), math.Ceil(math.Log10(maxY))
	if lx1 == lx0 {
		lx1++
	}
	if ly1 == ly0 {
		ly1++
	}
	px := func(x float64) int {
		return left + int((math.Log10(x)-lx0)/(lx1-lx0)*float64(W-left-right))
	}
	py := func(y float64) int {
		y = math.Max(y, 1e-6)
		return H - bottom - int((math.Log10(y)-ly0)/(ly1-ly0)*float64(H-top-bottom))
	}
	grey := color.RGBA{220, 220, 220, 255}
	black := color.RGBA{0, 0, 0, 255}
	for d := ly0; d <= ly1; d++ {
		y := py(math.Pow(10, d))
		line(img, left, y, W-right, y, grey)
		text(img, 8, y-3, fmt.Sprintf("1E%d S", int(d)), black)
	}
	for d := lx0; d <= lx1; d++ {
		x := px(math.Pow(10, d))
		line(img, x, top, x, H-bottom, grey)
		text(img, x-10, H-bottom+8, humanPow(d), black)
	}
	line(img, left, top, left, H-bottom, black)
	line(img, left, H-bottom, W-right, H-bottom, black)
	text(img, left, 10, "FORK ROOTFS COST VS PARENT UPPER LAYER SIZE (LOG-LOG)", black)
	text(img, W/2-60, H-bottom+22, "PARENT UPPER LAYER", black)
	for i, s := range ss {
		for j := 1; j < len(s.xs); j++ {
			thick(img, px(s.xs[j-1]), py(s.ys[j-1]), px(s.xs[j]), py(s.ys[j]), s.c)
		}
		for j := range s.xs {
			dot(img, px(s.xs[j]), py(s.ys[j]), s.c)
		}
		ly := H - bottom + 44 + i*16
		thick(img, left, ly+2, left+30, ly+2, s.c)
		text(img, left+40, ly, s.name, black)
	}
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

func humanPow(d float64) string {
	switch {
	case d >= 9:
		return fmt.Sprintf("%.0fGB", math.Pow(10, d-9))
	case d >= 6:
		return fmt.Sprintf("%.0fMB", math.Pow(10, d-6))
	case d >= 3:
		return fmt.Sprintf("%.0fKB", math.Pow(10, d-3))
	}
	return fmt.Sprintf("%.0fB", math.Pow(10, d))
}

func line(img *image.RGBA, x0, y0, x1, y1 int, c color.RGBA) {
	dx, dy := abs(x1-x0), -abs(y1-y0)
	sx, sy := sign(x1-x0), sign(y1-y0)
	err := dx + dy
	for {
		img.SetRGBA(x0, y0, c)
		if x0 == x1 && y0 == y1 {
			return
		}
		e2 := 2 * err
		if e2 >= dy {
			err += dy
			x0 += sx
		}
		if e2 <= dx {
			err += dx
			y0 += sy
		}
	}
}

func thick(img *image.RGBA, x0, y0, x1, y1 int, c color.RGBA) {
	for o := -1; o <= 1; o++ {
		line(img, x0, y0+o, x1, y1+o, c)
	}
}

func dot(img *image.RGBA, x, y int, c color.RGBA) {
	for i := -3; i <= 3; i++ {
		for j := -3; j <= 3; j++ {
			if i*i+j*j <= 9 {
				img.SetRGBA(x+i, y+j, c)
			}
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
	case v > 0:
		return 1
	case v < 0:
		return -1
	}
	return 0
}

// glyphs is a 3x5 pixel font: each glyph is 5 rows of 3 bits.
var glyphs = map[rune][5]string{
	'0': {"111", "101", "101", "101", "111"}, '1': {"010", "110", "010", "010", "111"},
	'2': {"111", "001", "111", "100", "111"}, '3': {"111", "001", "111", "001", "111"},
	'4': {"101", "101", "111", "001", "001"}, '5': {"111", "100", "111", "001", "111"},
	'6': {"111", "100", "111", "101", "111"}, '7': {"111", "001", "010", "010", "010"},
	'8': {"111", "101", "111", "101", "111"}, '9': {"111", "101", "111", "001", "111"},
	'A': {"010", "101", "111", "101", "101"}, 'B': {"110", "101", "110", "101", "110"},
	'C': {"111", "100", "100", "100", "111"}, 'D': {"110", "101", "101", "101", "110"},
	'E': {"111", "100", "110", "100", "111"}, 'F': {"111", "100", "110", "100", "100"},
	'G': {"111", "100", "101", "101", "111"}, 'H': {"101", "101", "111", "101", "101"},
	'I': {"111", "010", "010", "010", "111"}, 'J': {"001", "001", "001", "101", "111"},
	'K': {"101", "110", "100", "110", "101"}, 'L': {"100", "100", "100", "100", "111"},
	'M': {"101", "111", "111", "101", "101"}, 'N': {"110", "101", "101", "101", "101"},
	'O': {"111", "101", "101", "101", "111"}, 'P': {"111", "101", "111", "100", "100"},
	'Q': {"111", "101", "101", "111", "001"}, 'R': {"110", "101", "110", "101", "101"},
	'S': {"111", "100", "111", "001", "111"}, 'T': {"111", "010", "010", "010", "010"},
	'U': {"101", "101", "101", "101", "111"}, 'V': {"101", "101", "101", "101", "010"},
	'W': {"101", "101", "111", "111", "101"}, 'X': {"101", "101", "010", "101", "101"},
	'Y': {"101", "101", "010", "010", "010"}, 'Z': {"111", "001", "010", "100", "111"},
	'-': {"000", "000", "111", "000", "000"}, ',': {"000", "000", "000", "010", "100"},
	'(': {"010", "100", "100", "100", "010"}, ')': {"010", "001", "001", "001", "010"},
	'.': {"000", "000", "000", "000", "010"}, '/': {"001", "001", "010", "100", "100"},
}

// text draws s at (x, y) with 2x2 pixels per font pixel.
func text(img *image.RGBA, x, y int, s string, c color.RGBA) {
	for _, r := range strings.ToUpper(s) {
		g, ok := glyphs[r]
		if ok {
			for row := range 5 {
				for col := range 3 {
					if g[row][col] == '1' {
						for i := range 2 {
							for j := range 2 {
								img.SetRGBA(x+col*2+i, y+row*2+j, c)
							}
						}
					}
				}
			}
		}
		x += 8
	}
}
