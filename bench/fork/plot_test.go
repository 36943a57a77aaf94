package main

import (
	"encoding/csv"
	"image/png"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"testing"
)

// readResults loads a fork.csv as the bench wrote it.
func readResults(t *testing.T, path string) (*results, []int) {
	t.Helper()
	f, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	recs, err := csv.NewReader(f).ReadAll()
	if err != nil {
		t.Fatal(err)
	}
	r := &results{}
	var heaps []int
	for _, rec := range recs[1:] {
		h, err1 := strconv.Atoi(rec[0])
		v, err2 := strconv.ParseFloat(rec[3], 64)
		if err1 != nil || err2 != nil {
			t.Fatalf("%s: bad row %v", path, rec)
		}
		// The heap series: not the floors (heap 0) nor the breakdown's rows.
		if sys := rec[1]; (sys == "lazyfork" || sys == "plain") && !slices.Contains(heaps, h) {
			heaps = append(heaps, h)
		}
		r.add(h, rec[1], rec[2], v, rec[4])
	}
	return r, heaps
}

// The plots of the committed results render: three heap sizes as lines, one
// (fork100) as bars.
func TestPlotFromCommittedResults(t *testing.T) {
	for _, c := range []struct {
		csv   string
		forks int
	}{{"../results/fork.csv", 10}, {"../results/fork100/fork.csv", 100}} {
		r, heaps := readResults(t, c.csv)
		out := filepath.Join(t.TempDir(), "fork.png")
		if dir := os.Getenv("FORK_PLOT_DIR"); dir != "" { // to look at them
			out = filepath.Join(dir, filepath.Base(filepath.Dir(c.csv))+"-fork.png")
		}
		if err := writePlot(out, heaps, c.forks, r); err != nil {
			t.Fatalf("%s: %v", c.csv, err)
		}
		f, err := os.Open(out)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := png.Decode(f); err != nil {
			t.Errorf("%s: %v", out, err)
		}
		f.Close()
	}
}
