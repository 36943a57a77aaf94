package memfile

import (
	"archive/tar"
	"compress/gzip"
	"context"
	"io"
	"os"
	"path/filepath"
	"slices"
	"testing"

	"github.com/lazyfork/lazyfork/criuimg"
)

// The tests in this file run without root and without CRIU: they read
// testdata/dumps/tiny.tar.gz, a real CRIU dump of the two-process tree of
// testdata/dumps/tiny.c (regenerate with testdata/dumps/mkdumps.sh).
//
// tiny's memory: A (32 pages at tinyA, page i = byte i+1; the child rewrote
// pages 0..3 with 0xC0+i), E (8 untouched pages at tinyE), and C (the
// child's own 4 pages at tinyC, page i = byte 0xE0+i).
const (
	tinyA = 0x7e0000000000
	tinyE = 0x7e0000100000
	tinyC = 0x7e0000200000
)

// extractDump unpacks a committed dump into a fresh directory.
func extractDump(t testing.TB, name string) string {
	t.Helper()
	f, err := os.Open(filepath.Join("testdata", "dumps", name))
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	zr, err := gzip.NewReader(f)
	if err != nil {
		t.Fatal(err)
	}
	dir := filepath.Join(t.TempDir(), "img")
	if err := os.Mkdir(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	tr := tar.NewReader(zr)
	for {
		h, err := tr.Next()
		if err == io.EOF {
			return dir
		}
		if err != nil {
			t.Fatal(err)
		}
		if h.Typeflag != tar.TypeReg {
			continue
		}
		out, err := os.OpenFile(filepath.Join(dir, filepath.Base(h.Name)), os.O_WRONLY|os.O_CREATE|os.O_EXCL, 0o644)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := io.Copy(out, tr); err != nil {
			t.Fatal(err)
		}
		out.Close()
	}
}

// tinyStore opens a store in a temporary directory, removed with its
// sealed files after the test.
func tinyStore(t testing.TB) *Store {
	t.Helper()
	root := t.TempDir()
	s, err := OpenStore(root)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { RemoveAll(root) })
	return s
}

// tinyTasks returns the parent and the child of a loaded tiny dump.
func tinyTasks(t *testing.T, d *dump) (parent, child *task) {
	t.Helper()
	if len(d.tasks) != 2 || d.tasks[1].ppid != d.tasks[0].pid {
		t.Fatalf("tiny dump: want a parent and its child, got %d tasks", len(d.tasks))
	}
	return d.tasks[0], d.tasks[1]
}

func vmaAt(t *testing.T, tk *task, start uint64) *vmaPlan {
	t.Helper()
	for _, p := range tk.vmas {
		if p.e.GetStart() == start {
			return p
		}
	}
	t.Fatalf("pid %d: no VMA at %#x", tk.pid, start)
	return nil
}

func pageCount(runs []run) (n uint64) {
	for _, r := range runs {
		n += r.n
	}
	return n
}

// The load and plan phases classify tiny's VMAs: A and C (anonymous, with
// pages) convert, E (no pages) and the stack stay; a fresh dump is no delta
// and is not rebased.
func TestPlanTinyDump(t *testing.T) {
	dir := extractDump(t, "tiny.tar.gz")
	root := t.TempDir()
	d, err := loadDump(dir, root, filepath.Join(root, "fam"), RewriteOptions{Family: "fam", MapDir: "/mem"})
	if err != nil {
		t.Fatal(err)
	}
	defer d.close()
	pl, err := planVMAs(d, DefaultRebaseRatio)
	if err != nil {
		t.Fatal(err)
	}
	if pl.rebase || pl.wiped != 0 {
		t.Errorf("plan: rebase %v, wiped %d; want neither", pl.rebase, pl.wiped)
	}
	parent, child := tinyTasks(t, d)
	for _, c := range []struct {
		tk      *task
		start   uint64
		pages   uint64
		convert bool
	}{
		{parent, tinyA, 32, true}, {parent, tinyE, 0, false},
		{child, tinyA, 32, true}, {child, tinyE, 0, false}, {child, tinyC, 4, true},
	} {
		p := vmaAt(t, c.tk, c.start)
		if got := pageCount(p.overlay); got != c.pages || p.convert != c.convert || p.kind != vmaAnon {
			t.Errorf("pid %d VMA %#x: %d pages, convert %v, kind %d; want %d pages, convert %v, anonymous",
				c.tk.pid, c.start, got, p.convert, p.kind, c.pages, c.convert)
		}
	}
	for _, tk := range []*task{parent, child} {
		if !tk.changed {
			t.Errorf("pid %d: not marked changed", tk.pid)
		}
		for _, p := range tk.vmas {
			if p.e.GetFlags()&0x100 != 0 && p.convert { // MAP_GROWSDOWN
				t.Errorf("pid %d: stack VMA %#x converts", tk.pid, p.e.GetStart())
			}
		}
	}
}

// The rewrite of tiny moves A and C into one memory file, the child shares
// the parent's slot of A and keeps exactly the 4 pages it changed, and the
// new pagemaps list no converted page; the file holds the program's bytes.
func TestRewriteTinyDump(t *testing.T) {
	dir := extractDump(t, "tiny.tar.gz")
	s := tinyStore(t)
	res, err := s.Rewrite(context.Background(), dir, RewriteOptions{Family: "fam", MapDir: "/mem"})
	if err != nil {
		t.Fatal(err)
	}
	// A and C, and whatever else the program's runtime dirtied (its brk
	// heap, say); the child's A shares the parent's slot.
	if res.PagesMoved < 32+4 || res.NewFile == "" || !slices.Equal(res.Files, []string{res.NewFile}) {
		t.Errorf("result: moved %d pages (want at least 36), new file %q, files %v", res.PagesMoved, res.NewFile, res.Files)
	}
	tree, err := criuimg.ReadPstree(dir)
	if err != nil {
		t.Fatal(err)
	}
	ppid, cpid := tree[0].GetPid(), tree[1].GetPid()
	vmaOf := func(pid uint32, start uint64) (pgoff, shmid uint64) {
		mm, err := criuimg.ReadMM(dir, pid)
		if err != nil {
			t.Fatal(err)
		}
		for _, v := range mm.MM.GetVmas() {
			if v.GetStart() == start {
				if v.GetStatus()&vmaFilePrivate == 0 || v.GetFlags()&0x20 != 0 { // MAP_ANONYMOUS
					t.Errorf("pid %d VMA %#x: still anonymous (status %#x)", pid, start, v.GetStatus())
				}
				return v.GetPgoff(), v.GetShmid()
			}
		}
		t.Fatalf("pid %d: no VMA at %#x", pid, start)
		return 0, 0
	}
	pa, pid := vmaOf(ppid, tinyA)
	ca, cid := vmaOf(cpid, tinyA)
	cc, _ := vmaOf(cpid, tinyC)
	if pa != ca || pid != cid {
		t.Errorf("child's A maps offset %#x of file %d, parent's %#x of file %d: not shared", ca, cid, pa, pid)
	}
	if cc == pa || cc%uint64(SlotSize) != 0 || pa%uint64(SlotSize) != 0 {
		t.Errorf("slots: A at %#x, C at %#x; want distinct slot starts", pa, cc)
	}
	mem, err := os.Open(filepath.Join(s.Root(), "fam", res.NewFile))
	if err != nil {
		t.Fatal(err)
	}
	defer mem.Close()
	page := make([]byte, pageSize)
	checkPage := func(what string, f *os.File, off int64, want byte) {
		t.Helper()
		if _, err := f.ReadAt(page, off); err != nil {
			t.Fatalf("%s: %v", what, err)
		}
		for _, b := range page {
			if b != want {
				t.Errorf("%s: byte %#x, want %#x", what, b, want)
				return
			}
		}
	}
	for i := int64(0); i < 32; i++ {
		checkPage("memory file, A", mem, int64(pa)+i*pageSize, byte(i+1))
	}
	for i := int64(0); i < 4; i++ {
		checkPage("memory file, C", mem, int64(cc)+i*pageSize, byte(0xE0+i))
	}
	// The pagemaps: nothing of A, E or C in the parent's; in the child's,
	// A's pages 0..3 only, whose pages hold the child's bytes.
	for _, pid := range []uint32{ppid, cpid} {
		pm, err := criuimg.ReadPagemap(dir, pid)
		if err != nil {
			t.Fatal(err)
		}
		offs, total := pm.Offsets()
		pages, err := criuimg.OpenPages(dir, pm.PagesID, total)
		if err != nil {
			t.Fatal(err)
		}
		var inA uint64
		for i, e := range pm.Entries {
			lo, hi := e.GetVaddr(), e.GetVaddr()+uint64(e.GetNrPages())*pageSize
			for _, r := range [][2]uint64{{tinyA + 4*pageSize, tinyA + 32*pageSize}, {tinyE, tinyE + 8*pageSize}, {tinyC, tinyC + 4*pageSize}} {
				if lo < r[1] && hi > r[0] {
					t.Errorf("pid %d: pagemap keeps %#x-%#x, inside converted or empty memory", pid, lo, hi)
				}
			}
			if lo < tinyA+4*pageSize && hi > tinyA {
				for va := max(lo, tinyA); va < min(hi, tinyA+4*pageSize); va += pageSize {
					inA++
					checkPage("child's kept page", pages.File, offs[i]+int64(va-lo), byte(0xC0+(va-tinyA)/pageSize))
				}
			}
		}
		pages.Close()
		if want := map[uint32]uint64{ppid: 0, cpid: 4}[pid]; inA != want {
			t.Errorf("pid %d: keeps %d pages of A, want %d", pid, inA, want)
		}
	}
	info, err := ReadSnapshot(dir)
	if err != nil || info.Pages != res.PagesMoved || info.KeptPages == 0 {
		t.Errorf("snapshot record: %+v, %v", info, err)
	}
	if h, _ := s.Holders("fam"); len(h) != 1 {
		t.Errorf("holders: %v, want the snapshot's", h)
	}
}
