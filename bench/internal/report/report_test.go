package report

import (
	"bytes"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

func TestTableCSVAndPrint(t *testing.T) {
	var m Measurements
	m.Add("baseline", "restore1_s", "copy-1", 0.37512, "s")
	m.Add("baseline", "restore1_memory_bytes", "copy-1", 278011904, "bytes")
	path := filepath.Join(t.TempDir(), "sub", "x.csv")
	if err := m.Table().WriteCSV(path); err != nil {
		t.Fatal(err)
	}
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	want := "scenario,metric,subject,value,unit\nbaseline,restore1_s,copy-1,0.3751,s\nbaseline,restore1_memory_bytes,copy-1,278011904,bytes\n"
	if string(b) != want {
		t.Errorf("csv:\n%s\nwant:\n%s", b, want)
	}
	if ents, _ := os.ReadDir(filepath.Dir(path)); len(ents) != 1 {
		t.Errorf("temp files left: %v", ents)
	}
	tb := &Table{Columns: []string{"a", "bb"}}
	tb.Add("x", 1500*time.Millisecond)
	var out bytes.Buffer
	tb.Print(&out)
	if !strings.Contains(out.String(), "x  1.500") {
		t.Errorf("print:\n%s", out.String())
	}
}

func TestMedianMax(t *testing.T) {
	if m := Median([]time.Duration{3, 1, 2}); m != 2 {
		t.Errorf("odd median %v", m)
	}
	if m := Median([]float64{4, 1, 3, 2}); m != 2.5 {
		t.Errorf("even median %v", m)
	}
	if m := Median[float64](nil); m != 0 {
		t.Errorf("empty median %v", m)
	}
	if m := Max([]int64{-5, -2, -9}); m != -2 {
		t.Errorf("max %v", m)
	}
	if m := Min([]float64{5, 2, 9}); m != 2 {
		t.Errorf("min %v", m)
	}
}
