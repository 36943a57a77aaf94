package rehome

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
)

// TestScanWrittenMatchesPagemap: PAGEMAP_SCAN finds exactly the runs of
// private copies a pagemap read finds, in every mapping of a process moved
// onto a memory file and written since (spread pages inside file mappings,
// anonymous memory, the stack), and both see a guard region.
func TestScanWrittenMatchesPagemap(t *testing.T) {
	p := startProg(t, 64)
	dir := tmpfs(t)
	rehome(t, p, "", filepath.Join(dir, "a"))
	spread(t, p, map[uint64]bool{}, 29, 3)
	spread(t, p, map[uint64]bool{}, 1000, 1) // and runs of neighbours
	guarded := p.heap[0]&^(pageSize-1) + 100*pageSize
	guardOK := p.cmdLine(fmt.Sprintf("guard %x %x", guarded, pageSize)) == "guard 0"
	if !guardOK {
		t.Log("MADV_GUARD_INSTALL refused on a file mapping: no guard case")
	}
	p.idle()
	tr, err := Seize("", p.pid)
	if err != nil {
		t.Fatal(err)
	}
	defer tr.Detach()
	pm, err := os.Open(fmt.Sprintf("/proc/%d/pagemap", p.pid))
	if err != nil {
		t.Fatal(err)
	}
	defer pm.Close()
	maps, err := os.ReadFile(fmt.Sprintf("/proc/%d/maps", p.pid))
	if err != nil {
		t.Fatal(err)
	}
	var scanned, pages int
	sawGuard := false
	for l := range strings.SplitSeq(string(maps), "\n") {
		v, _, ok := parseHeader([]byte(l))
		if !ok || strings.HasSuffix(l, "[vsyscall]") {
			continue
		}
		s, sg, err := scanWritten(pm, v.Start, v.End)
		if errors.Is(err, errNoScan) {
			t.Skip("this kernel has no PAGEMAP_SCAN (Linux 6.7) with guard regions (6.15)")
		}
		if err != nil {
			t.Fatalf("%s: %v", l, err)
		}
		r, rg, err := readWritten(pm, v.Start, v.End)
		if err != nil {
			t.Fatalf("%s: %v", l, err)
		}
		if !slices.Equal(s, r) || sg != rg {
			t.Errorf("%s: PAGEMAP_SCAN %d runs (guard %v), pagemap %d runs (guard %v); first %v against %v",
				l, len(s), sg, len(r), rg, s[:min(3, len(s))], r[:min(3, len(r))])
		}
		scanned++
		for _, w := range s {
			pages += int(w[1]-w[0]) / pageSize
		}
		sawGuard = sawGuard || sg
	}
	t.Logf("%d mappings, %d pages held privately", scanned, pages)
	if pages < 500 {
		t.Errorf("%d pages held privately: the spread writes should have made over 500", pages)
	}
	if guardOK && !sawGuard {
		t.Error("no mapping reports the guard region installed")
	}
}
