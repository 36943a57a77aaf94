package main

import (
	"encoding/csv"
	"image/png"
	"os"
	"path/filepath"
	"strconv"
	"testing"
)

// The plot of the committed results renders from the CSV the bench wrote
// (medians only: the CSV keeps no runs, so no error bars).
func TestPlotFromCommittedResults(t *testing.T) {
	f, err := os.Open("../results/snapshotter.csv")
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	recs, err := csv.NewReader(f).ReadAll()
	if err != nil {
		t.Fatal(err)
	}
	num := func(s string) float64 {
		v, err := strconv.ParseFloat(s, 64)
		if err != nil {
			t.Fatalf("bad number %q", s)
		}
		return v
	}
	var rs []result
	for _, c := range recs[1:] {
		rs = append(rs, result{FS: c[0], SizeBytes: int64(num(c[1])), Method: c[2], Mechanism: c[3], Forks: int(num(c[4])),
			FreezeSec: num(c[5]), BulkSec: num(c[6]), PrepareSec: num(c[7]), PerForkSec: num(c[8]), ParentPause: num(c[9]),
			DiskBytes: int64(num(c[10])), FSUsedDelta: int64(num(c[11])), Runs: int(num(c[12]))})
	}
	out := filepath.Join(t.TempDir(), "snapshotter.png")
	if dir := os.Getenv("SNAPSHOTTER_PLOT_DIR"); dir != "" { // to look at it
		out = filepath.Join(dir, "snapshotter.png")
	}
	if err := writePlot(out, rs); err != nil {
		t.Fatal(err)
	}
	g, err := os.Open(out)
	if err != nil {
		t.Fatal(err)
	}
	defer g.Close()
	if _, err := png.Decode(g); err != nil {
		t.Error(err)
	}
}
