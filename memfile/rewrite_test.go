package memfile_test

import (
	"os"
	"path/filepath"
	"syscall"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/lazyfork/lazyfork/criuimg"
	"github.com/lazyfork/lazyfork/internal/procfs"
	"github.com/lazyfork/lazyfork/memfile"
)

const heapMiB = 64

// TestRewriteRestore: a tree with a known heap is dumped, rewritten and
// restored twice side by side; every process of every copy passes a full
// check of its memory, a copy's private memory is tiny, writes stay private,
// and mremap growth in a copy reads zeros.
func TestRewriteRestore(t *testing.T) {
	e := newEnv(t)
	orig := e.start(heapMiB, 1)
	dir := e.dump(orig)
	res := e.rewrite(dir)

	if res.PagesMoved < heapMiB<<8 {
		t.Errorf("moved %d pages, expected at least the heap's %d", res.PagesMoved, heapMiB<<8)
	}
	// The child shares the parent's region and keeps only its 10 different pages.
	if res.PagesKept > 200 {
		t.Errorf("kept %d pages in the image, expected a few dozen", res.PagesKept)
	}
	info, err := memfile.ReadSnapshot(dir)
	if err != nil {
		t.Fatal(err)
	}
	if info.Family != e.family || len(info.Files) != 1 || info.Parent != "" {
		t.Fatalf("snapshot info %+v", info)
	}
	st, err := os.Stat(filepath.Join(e.famDir, info.Files[0]))
	if err != nil {
		t.Fatal(err)
	}
	if st.Mode().Perm() != 0o400 {
		t.Errorf("memory file mode %v, expected 0400", st.Mode())
	}
	// No private anonymous VMA with pages is left, and pages images are small.
	checkNoAnonPages(t, dir)
	// The root's VMAs that map the new memory file share one file id: CRIU
	// opens the file once for a run of them, not once per VMA. (A child's
	// VMA that maps its own region where the parent maps another gets an id
	// of its own: CRIU would take it for a copy-on-write share.)
	files, err := criuimg.ReadFiles(dir)
	if err != nil {
		t.Fatal(err)
	}
	memIDs := map[uint64]bool{}
	for _, fe := range files.Entries {
		if filepath.Base(fe.GetReg().GetName()) == info.Files[0] {
			memIDs[uint64(fe.GetId())] = true
		}
	}
	tree, err := criuimg.ReadPstree(dir)
	if err != nil {
		t.Fatal(err)
	}
	mm, err := criuimg.ReadMM(dir, tree[0].GetPid())
	if err != nil {
		t.Fatal(err)
	}
	vmas, ids := 0, map[uint64]bool{}
	for _, v := range mm.MM.GetVmas() {
		if v.GetStatus()&(1<<6) != 0 && memIDs[v.GetShmid()] {
			vmas++
			ids[v.GetShmid()] = true
		}
	}
	if vmas < 2 || len(ids) != 1 {
		t.Errorf("the root maps the memory file in %d VMAs with %d file ids, want several VMAs and one id", vmas, len(ids))
	}
	// Without TCP connections, restores skip CRIU's network lock.
	if inv, err := criuimg.ReadInventory(dir); err != nil || inv.GetNetworkLockMethod() != 2 {
		t.Errorf("inventory network lock method %d (%v), want 2 (skip)", inv.GetNetworkLockMethod(), err)
	}

	a, b := e.restore(dir), e.restore(dir)
	for _, c := range []int{a, b} {
		if anon := rssAnon(t, c); anon > 4<<20 {
			t.Errorf("copy %d: RssAnon %d kB right after restore", c, anon>>10)
		} else {
			t.Logf("copy %d: RssAnon %d kB right after restore (heap %d MiB)", c, anon>>10, heapMiB)
		}
		e.verifyTree(c)
	}
	// A write in one copy is seen by no other copy, nor the parent.
	e.ask(a, syscall.SIGHUP, "dirty")
	e.verifyTree(a)
	e.verifyTree(b)
	e.verifyTree(orig)

	// mremap growth reads zeros: R moves past its neighbour, G grows in place.
	r := e.ask(b, syscall.SIGUSR2, "grow")
	if r["ok"] != "1" || r["nonzero"] != "0" {
		t.Fatalf("growth exposed data: %s", r["line"])
	}
	if r["inplace_nonzero"] == "-1" {
		t.Logf("in-place growth not possible in this copy: %s", r["line"])
	}
	e.verifyTree(b)

	// The memory file is unchanged by all of this.
	st2, _ := os.Stat(filepath.Join(e.famDir, info.Files[0]))
	if st2.Size() != st.Size() || st2.ModTime() != st.ModTime() {
		t.Errorf("memory file changed under the copies")
	}
}

func checkNoAnonPages(t testing.TB, dir string) {
	t.Helper()
	tree, err := criuimg.ReadPstree(dir)
	if err != nil {
		t.Fatal(err)
	}
	for _, task := range tree {
		mm, err := criuimg.ReadMM(dir, task.GetPid())
		if err != nil {
			t.Fatal(err)
		}
		pm, err := criuimg.ReadPagemap(dir, task.GetPid())
		if err != nil {
			t.Fatal(err)
		}
		var anonPages uint64
		for _, e := range pm.Entries {
			for _, v := range mm.MM.GetVmas() {
				if e.GetVaddr() >= v.GetStart() && e.GetVaddr() < v.GetEnd() &&
					v.GetFlags()&unix.MAP_ANONYMOUS != 0 && v.GetFlags()&unix.MAP_GROWSDOWN == 0 &&
					v.GetStatus()&(1<<9) != 0 && v.GetStatus()&(1<<12|1<<3|1<<2) == 0 {
					anonPages += uint64(e.GetNrPages())
				}
			}
		}
		if anonPages != 0 {
			t.Errorf("pid %d: %d pages of private anonymous VMAs left in the image", task.GetPid(), anonPages)
		}
		_, total := pm.Offsets()
		t.Logf("pid %d: %d bytes of pages left in the image", task.GetPid(), total)
	}
}

// TestTreeChain: a child dirties pages and forks a grandchild that keeps
// them. All three share one region; each keeps exactly the pages where it
// differs from the file, so CRIU's own sharing between them holds and no
// page is dropped back to the file's bytes.
func TestTreeChain(t *testing.T) {
	e := newEnv(t)
	orig := e.startChain(16, 1, 3)
	dir := e.dump(orig)
	res := e.rewrite(dir)
	if res.PagesMoved > (16+4)<<8+200 { // heap R and G, once
		t.Errorf("moved %d pages: the tree's copies of the heap were not shared", res.PagesMoved)
	}
	c := e.restore(dir)
	pids, _ := procfs.Tree(c)
	if len(pids) != 4 {
		t.Fatalf("restored tree %v", pids)
	}
	e.verifyTree(c)
	// And again from a dump of the restored tree.
	d := e.dump(c)
	e.rewrite(d)
	e.verifyTree(e.restore(d))
}
