package main

import (
	"image/png"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/lazyfork/lazyfork/internal/procfs"
)

// The plot and CSV come out of any set of rows, including an empty measurement.
func TestPlotAndCSV(t *testing.T) {
	var rows []row
	for i, h := range []int{64, 256, 1024, 2048} {
		rows = append(rows,
			row{HeapMiB: h, Mode: "memfile", Restore1: 30 * time.Millisecond, Restore10Mean: 50 * time.Millisecond,
				After: procfs.Mem{RssAnon: 300 << 10}, After5s: procfs.Mem{Pss: int64(i+1) << 20, RssShmem: 2 << 20}},
			row{HeapMiB: h, Mode: "plain", Restore1: time.Duration(h) * time.Millisecond, After: procfs.Mem{RssAnon: int64(h) << 20}})
	}
	dir := t.TempDir()
	p := filepath.Join(dir, "x.png")
	if err := writePlot(p, rows); err != nil {
		t.Fatal(err)
	}
	f, err := os.Open(p)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	img, err := png.Decode(f)
	if err != nil || img.Bounds().Dx() < 800 {
		t.Fatalf("png: %v %v", img, err)
	}
	if err := writeCSV(filepath.Join(dir, "x.csv"), rows); err != nil {
		t.Fatal(err)
	}
}
