package memfile_test

import (
	"context"
	"slices"
	"syscall"
	"testing"

	"github.com/lazyfork/lazyfork/memfile"
)

// TestPatchedDeltas: a copy running on its files (as a moved parent does)
// is dumped three times without being moved again, so each dump holds
// every page it wrote since it was restored. With RewriteOptions.Patch the
// rewrite turns those pages into patches of memory files: each snapshot's
// copies restore with none of them in their private memory, a snapshot
// whose written pages a previous patch already holds writes no new memory
// file, and a write over a patched page gets a new patch. Every copy
// verifies its memory, its child's included.
func TestPatchedDeltas(t *testing.T) {
	e := newEnv(t)
	orig := e.start(heapMiB, 1)
	dir := e.dump(orig)
	first := e.rewrite(dir)
	parent := e.restore(dir)
	kill(orig)

	rewrite := func(dir string, prev []memfile.Patch) *memfile.Result {
		t.Helper()
		res, err := e.store.Rewrite(context.Background(), dir, memfile.RewriteOptions{
			Family: e.family, MapDir: e.famDir, Patch: &memfile.PatchOptions{Previous: prev}})
		if err != nil {
			t.Fatal(err)
		}
		t.Logf("rewrite: moved %d pages (%d reused), kept %d, wrote %d bytes, new file %q, %d patches, files %v",
			res.PagesMoved, res.PagesReused, res.PagesKept, res.BytesWritten, res.NewFile, len(res.Patches), res.Files)
		if res.Rebased {
			t.Fatal("a patched rewrite rebased")
		}
		if !slices.Contains(res.Files, first.Files[0]) {
			t.Fatalf("snapshot does not map the first file %s: %v", first.Files[0], res.Files)
		}
		return res
	}
	check := func(dir string) int {
		t.Helper()
		c := e.restore(dir)
		e.verifyTree(c)
		// The copy's written heap pages are patches, not its own memory.
		if anon := rssAnon(t, c); anon > 4<<20 {
			t.Errorf("copy of a patched snapshot: RssAnon %d kB", anon>>10)
		}
		return c
	}

	// 1. Ten pages written: patches in a new file, nothing of the heap kept.
	e.ask(parent, syscall.SIGHUP, "dirty")
	d1 := e.dump(parent)
	res1 := rewrite(d1, nil)
	if res1.NewFile == "" || len(res1.Patches) == 0 || res1.PagesReused != 0 {
		t.Fatalf("first patched snapshot: %+v", res1)
	}
	for _, p := range res1.Patches {
		if p.File != res1.NewFile {
			t.Errorf("patch %+v is not in the new file %s", p, res1.NewFile)
		}
	}
	kill(check(d1))

	// 2. No heap page written since: the heap's patches are the previous
	// snapshot's. (Only the few pages the program's own bookkeeping
	// changed meanwhile, its report and signal handling, are new.)
	d2 := e.dump(parent)
	res2 := rewrite(d2, res1.Patches)
	if res2.PagesReused < 10 || res2.PagesMoved-res2.PagesReused > 8 || res2.BytesWritten >= res1.BytesWritten {
		t.Errorf("unchanged pages written again: moved %d, reused %d, wrote %d bytes (the first time %d)",
			res2.PagesMoved, res2.PagesReused, res2.BytesWritten, res1.BytesWritten)
	}
	if !slices.Contains(res2.Files, res1.NewFile) {
		t.Errorf("snapshot does not pin the reused patches' file %s: %v", res1.NewFile, res2.Files)
	}
	c2 := check(d2)

	// 3. Half the heap written over (the ten patched pages included): new
	// patches where it differs, still no rebase and nothing kept.
	e.ask(parent, syscall.SIGTTIN, "dirty")
	d3 := e.dump(parent)
	res3 := rewrite(d3, res2.Patches)
	if res3.NewFile == "" || res3.PagesMoved-res3.PagesReused < uint64(heapMiB<<20/4096/2)-64 {
		t.Errorf("half the heap written: %+v", res3)
	}
	if res3.PagesKept > 400 {
		t.Errorf("patched snapshot keeps %d pages in the image", res3.PagesKept)
	}
	c3 := check(d3)
	// The copies of the earlier snapshots still see their own memory.
	e.verifyTree(c2)
	e.verifyTree(parent)
	kill(c2)
	kill(c3)
}
