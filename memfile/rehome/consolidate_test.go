package rehome

import (
	"encoding/binary"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/containerd/errdefs"
)

// heapMappings counts the mappings of process pid inside [start, end).
func heapMappings(t testing.TB, pid int, start, end uint64) int {
	t.Helper()
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/maps", pid))
	if err != nil {
		t.Fatal(err)
	}
	n := 0
	for l := range strings.SplitSeq(string(b), "\n") {
		if v, _, ok := parseHeader([]byte(l)); ok && v.End > start && v.Start < end {
			n++
		}
	}
	return n
}

// spread has p flip word 1 of heap pages off, off+stride... and records
// them in flips: the test's own account of what p wrote (p's is in its
// memory, which a lost write could turn back with it).
func spread(t testing.TB, p *prog, flips map[uint64]bool, stride, off uint64) {
	t.Helper()
	if l := p.cmdLine(fmt.Sprintf("spread %d %d", stride, off)); !strings.HasPrefix(l, "spread ") {
		t.Fatalf("spread: %q", l)
	}
	for pg := off; pg < p.heap[1]/pageSize; pg += stride {
		flips[pg] = !flips[pg]
	}
}

// checkFlips reads p's heap through /proc/pid/mem and checks word 1 of
// every page against flips, and then has p verify the rest.
func checkFlips(t testing.TB, p *prog, flips map[uint64]bool) {
	t.Helper()
	mem, err := os.Open(fmt.Sprintf("/proc/%d/mem", p.pid))
	if err != nil {
		t.Fatal(err)
	}
	defer mem.Close()
	b := make([]byte, p.heap[1])
	if _, err := mem.ReadAt(b, int64(p.heap[0])); err != nil {
		t.Fatal(err)
	}
	bad := 0
	for pg := uint64(0); pg < p.heap[1]/pageSize; pg++ {
		want := pat(pg, 1)
		if flips[pg] {
			want ^= 0xff
		}
		if got := binary.LittleEndian.Uint64(b[pg*pageSize+8:]); got != want {
			if bad < 5 {
				t.Errorf("heap page %d word 1 = %#x, want %#x (flipped %v)", pg, got, want, flips[pg])
			}
			bad++
		}
	}
	if bad > 0 {
		t.Fatalf("%d heap pages lost what the process wrote", bad)
	}
	p.verify()
}

// patchMove is a later move of p: the pages it wrote inside its mappings of
// files under dir become patches mapped from a new file, name.
func patchMove(t testing.TB, p *prog, dir, name string) {
	t.Helper()
	p.idle()
	tr, err := Seize("", p.pid)
	if err != nil {
		t.Fatal(err)
	}
	defer func() {
		if err := tr.Detach(); err != nil {
			t.Error(err)
		}
	}()
	vmas, err := PlanWith(p.pid, PlanOptions{MemDir: dir})
	if err != nil {
		t.Fatal(err)
	}
	f, err := os.Create(filepath.Join(dir, name))
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if _, _, err := tr.MoveFile(p.pid, f, f.Name(), vmas, 0); err != nil {
		t.Fatalf("patch move: %v", err)
	}
}

// fragment moves p onto dir/a, then has it write pages spread over its heap
// and moves them three times, as a parent forked after spread writes: its
// heap becomes hundreds of mappings.
func fragment(t *testing.T) (*prog, string, map[uint64]bool) {
	p := startProg(t, 64)
	dir := tmpfs(t)
	rehome(t, p, "", filepath.Join(dir, "a"))
	flips := map[uint64]bool{}
	for r := range 3 {
		spread(t, p, flips, 29, uint64(r))
		patchMove(t, p, dir, fmt.Sprintf("m%d", r))
		checkFlips(t, p, flips)
	}
	return p, dir, flips
}

// fragmentAndPrepare fragments a process (fragment) and prepares the
// consolidation of its regions into a file c, as the shim does in the
// pause before a checkpoint, while the process runs.
func fragmentAndPrepare(t *testing.T) (p *prog, dir string, flips map[uint64]bool, prepared []VMA, c *os.File) {
	p, dir, flips = fragment(t)
	regions, err := Fragments(p.pid, dir, false)
	if err != nil {
		t.Fatal(err)
	}
	if c, err = os.Create(filepath.Join(dir, "c")); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	if prepared, _, err = PrepareRegions(regions, dir, c); err != nil {
		t.Fatal(err)
	}
	return p, dir, flips, prepared, c
}

// consolidate is the checkpoint's move of p's prepared regions from c, in
// chunks of chunk bytes (0: the default).
func consolidate(t *testing.T, p *prog, c *os.File, prepared []VMA, chunk uint64) ([]VMA, CopyStats, error) {
	t.Helper()
	p.idle()
	tr, err := Seize("", p.pid)
	if err != nil {
		t.Fatal(err)
	}
	done, st, err := tr.MoveFile(p.pid, c, c.Name(), prepared, chunk)
	if derr := tr.Detach(); derr != nil {
		t.Error(derr)
	}
	return done, st, err
}

// TestConsolidateSpreadWrites: a heap fragmented by spread writes and their
// patch moves is put back into one mapping by a consolidation (prepared
// while the process runs, pages written after the preparation included),
// holds no private page, and verifies; the file keeps its bytes under the
// process's later writes.
func TestConsolidateSpreadWrites(t *testing.T) {
	p, dir, flips := fragment(t)
	hs, he := p.heap[0]&^(pageSize-1), p.heap[0]+p.heap[1]
	before := heapMappings(t, p.pid, hs, he)
	t.Logf("heap in %d mappings after three spread moves", before)
	if before < 200 {
		t.Fatalf("heap in %d mappings: the spread moves did not fragment it", before)
	}

	regions, err := Fragments(p.pid, dir, false)
	if err != nil {
		t.Fatal(err)
	}
	heapR := vmaAt(t, regions, p.heap[0])
	t.Logf("%d regions, %d pieces; heap region %v in %d pieces", len(regions), Pieces(regions), heapR, len(heapR.Pieces))
	c, err := os.Create(filepath.Join(dir, "c"))
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	prepared, n, err := PrepareRegions(regions, dir, c)
	if err != nil || len(prepared) != len(regions) {
		t.Fatalf("PrepareRegions: %d of %d regions: %v", len(prepared), len(regions), err)
	}
	t.Logf("prepared %d MiB", n>>20)

	// Written after the preparation, and some pages written back (flipped
	// twice: their bytes are the file's again, in private copies).
	spread(t, p, flips, 31, 7)
	spread(t, p, flips, 29, 0)

	done, st, err := consolidate(t, p, c, prepared, 0)
	if err != nil || len(done) != len(prepared) {
		t.Fatalf("consolidating move: %d of %d regions: %v", len(done), len(prepared), err)
	}
	t.Logf("consolidated: %+v", st)
	checkFlips(t, p, flips)

	after := heapMappings(t, p.pid, hs, he)
	hdr, fl := smapsEntry(t, p.pid, p.heap[0])
	t.Logf("heap in %d mappings: %s, Anonymous %d kB", after, hdr, fl["Anonymous"])
	if after > 3 {
		t.Errorf("heap in %d mappings after the consolidation, want one (a malloc'd block may share its ends)", after)
	}
	if !strings.HasSuffix(hdr, c.Name()) {
		t.Errorf("heap maps %s, not the consolidated file", hdr)
	}
	// (The region may hold a thread's stack too, which it writes on.)
	if fl["Anonymous"] > 256 {
		t.Errorf("heap region holds %d kB of private pages after the consolidation, of %d kB written", fl["Anonymous"], st.Bytes>>10)
	}

	// Later writes stay private; the file keeps the bytes of the move.
	patchMove(t, p, dir, "m9") // nothing from c is written
	spread(t, p, flips, 101, 3)
	checkFlips(t, p, flips)
	if after2 := heapMappings(t, p.pid, hs, he); after2 != after {
		t.Logf("heap in %d mappings after more writes", after2)
	}
}

// TestConsolidateRefusesChangedRegion: a region whose mappings changed
// between the preparation and the move (another move patched it) is refused
// as a whole; the process keeps its mappings and its memory.
func TestConsolidateRefusesChangedRegion(t *testing.T) {
	p, dir, flips, prepared, c := fragmentAndPrepare(t)
	spread(t, p, flips, 37, 11)
	patchMove(t, p, dir, "m8")
	hs, he := p.heap[0]&^(pageSize-1), p.heap[0]+p.heap[1]
	before := heapMappings(t, p.pid, hs, he)

	done, _, err := consolidate(t, p, c, prepared, 0)
	if !errors.Is(err, errdefs.ErrFailedPrecondition) || len(done) != 0 {
		t.Fatalf("move of changed regions: %d done, err %v; want none, failed precondition", len(done), err)
	}
	checkFlips(t, p, flips)
	if after := heapMappings(t, p.pid, hs, he); after != before {
		t.Errorf("heap in %d mappings after a refused consolidation, was %d", after, before)
	}
}

// TestStillPrepared: the regions a move may still map from a consolidation
// are the unchanged ones; after a patch move cut one up, it is left out.
func TestStillPrepared(t *testing.T) {
	p, dir, _ := fragment(t)
	regions, err := Fragments(p.pid, dir, false)
	if err != nil {
		t.Fatal(err)
	}
	if len(regions) == 0 {
		t.Fatal("a fragmented heap has no region to consolidate")
	}
	got, err := StillPrepared(p.pid, regions)
	if err != nil {
		t.Fatal(err)
	}
	if len(got) != len(regions) {
		t.Fatalf("%d of %d unchanged regions still prepared", len(got), len(regions))
	}
	flips := map[uint64]bool{}
	spread(t, p, flips, 37, 11)
	patchMove(t, p, dir, "m8")
	if got, err = StillPrepared(p.pid, regions); err != nil {
		t.Fatal(err)
	}
	for _, r := range got {
		if r.Start < p.heap[0]+p.heap[1] && p.heap[0] < r.End {
			t.Errorf("region %v over the heap, cut up by a move since, is still prepared", r)
		}
	}
}

// TestConsolidateKeepsGuardPages: a guard page the process installs in a
// region after its preparation fails that region's consolidation (mapping
// the region anew would drop the guard) before any of it is mapped, though
// it lies many chunks in, and the process keeps its guard, its mappings,
// its writes since the preparation and the rest of its memory.
func TestConsolidateKeepsGuardPages(t *testing.T) {
	p, _, flips, prepared, c := fragmentAndPrepare(t)
	spread(t, p, flips, 31, 5)
	// A page of the heap none of the spread writes flipped (word 1 of
	// heap pages, which are not page-aligned: the two it overlaps): its
	// bytes are the file's when the guard goes.
	guarded := (p.heap[0] + 8<<20) &^ (pageSize - 1)
	for ; ; guarded += pageSize {
		pg := (guarded - p.heap[0]) / pageSize
		if !flips[pg] && !flips[pg+1] && pg%29 > 2 && (pg+1)%29 > 2 {
			break
		}
	}
	if l := p.cmdLine(fmt.Sprintf("guard %x %x", guarded, pageSize)); l != "guard 0" {
		t.Skipf("MADV_GUARD_INSTALL on a file mapping: %q (Linux 6.15+)", l)
	}
	isGuard := func() bool {
		pm, err := os.Open(fmt.Sprintf("/proc/%d/pagemap", p.pid))
		if err != nil {
			t.Fatal(err)
		}
		defer pm.Close()
		var b [8]byte
		if _, err := pm.ReadAt(b[:], int64(guarded/pageSize*8)); err != nil {
			t.Fatal(err)
		}
		return binary.LittleEndian.Uint64(b[:])&pmGuard != 0
	}
	if !isGuard() {
		t.Fatal("the guard page installed is not in the pagemap")
	}

	hs, he := p.heap[0]&^(pageSize-1), p.heap[0]+p.heap[1]
	before := heapMappings(t, p.pid, hs, he)
	done, _, err := consolidate(t, p, c, prepared, 1<<20)
	if after := heapMappings(t, p.pid, hs, he); after != before {
		t.Errorf("heap in %d mappings after a consolidation refused for a guard page, was %d", after, before)
	}
	if !errdefs.IsNotImplemented(err) || !strings.Contains(err.Error(), "guard") {
		t.Errorf("consolidation of a region with a guard page: %v; want an error naming the guard", err)
	}
	for _, v := range done {
		if v.Start <= guarded && guarded < v.End {
			t.Errorf("region %v with the guard page consolidated", v)
		}
	}
	if !isGuard() {
		t.Error("the guard page was lost")
	}
	hdr, _ := smapsEntry(t, p.pid, guarded)
	t.Logf("guarded page in %s", hdr)
	if l := p.cmdLine(fmt.Sprintf("unguard %x %x", guarded, pageSize)); l != "unguard 0" {
		t.Fatalf("MADV_GUARD_REMOVE: %q", l)
	}
	checkFlips(t, p, flips)
}
