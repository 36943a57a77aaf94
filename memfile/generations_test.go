package memfile_test

import (
	"slices"
	"syscall"
	"testing"

	"github.com/lazyfork/lazyfork/memfile"
)

// TestForksOfForks: a copy is dumped again; its dump holds only the pages
// the copy wrote, the rewrite keeps them as a small delta on top of the same
// file, and the grandchild restores. Nine generations, each dirtying a few
// pages; then a big delta triggers a rebase into a fresh file.
func TestForksOfForks(t *testing.T) {
	e := newEnv(t)
	orig := e.start(heapMiB, 1)
	dir := e.dump(orig)
	first := e.rewrite(dir)
	base := first.Files[0]

	cur := e.restore(dir)
	for gen := 1; gen <= 9; gen++ {
		e.ask(cur, syscall.SIGHUP, "dirty")
		e.verifyTree(cur)
		d := e.dump(cur)
		res := e.rewrite(d)
		if res.Rebased {
			t.Fatalf("generation %d rebased a small delta", gen)
		}
		if !slices.Contains(res.Files, base) {
			t.Fatalf("generation %d does not map the base file: %v", gen, res.Files)
		}
		// The delta: the 10+10 pages the copies wrote, the child's 10, stacks
		// and libc data; never the heap.
		if res.PagesKept > 400 || res.PagesMoved > 400 {
			t.Fatalf("generation %d: kept %d, moved %d pages: not a small delta", gen, res.PagesKept, res.PagesMoved)
		}
		info, err := memfile.ReadSnapshot(d)
		if err != nil {
			t.Fatal(err)
		}
		if info.Parent == "" {
			t.Errorf("generation %d: no parent recorded: %+v", gen, info)
		}
		next := e.restore(d)
		e.verifyTree(next)
		if anon := rssAnon(t, next); anon > 4<<20 {
			t.Errorf("generation %d: RssAnon %d kB", gen, anon>>10)
		}
		kill(cur)
		cur = next
	}

	// Half the heap rewritten: the delta is bigger than a quarter of the
	// shared pages, so the snapshot is rebased into a fresh file.
	e.ask(cur, syscall.SIGTTIN, "dirty")
	d := e.dump(cur)
	res := e.rewrite(d)
	if !res.Rebased || slices.Contains(res.Files, base) {
		t.Fatalf("big delta not rebased: %+v", res)
	}
	if res.PagesKept > 400 {
		t.Errorf("rebased snapshot keeps %d pages in the image", res.PagesKept)
	}
	next := e.restore(d)
	e.verifyTree(next)
	if anon := rssAnon(t, next); anon > 4<<20 {
		t.Errorf("rebased copy: RssAnon %d kB", anon>>10)
	}
	r := e.ask(next, syscall.SIGUSR2, "grow")
	if r["ok"] != "1" {
		t.Fatalf("growth in a rebased copy: %s", r["line"])
	}
	// And a copy of the rebased copy.
	e.ask(next, syscall.SIGHUP, "dirty")
	d2 := e.dump(next)
	res2 := e.rewrite(d2)
	if res2.Rebased || !slices.Equal(res2.Files, res.Files) && len(res2.Files) > len(res.Files)+1 {
		t.Fatalf("copy of a rebased copy: %+v", res2)
	}
	e.verifyTree(e.restore(d2))
}
