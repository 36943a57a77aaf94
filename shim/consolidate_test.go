package shim

import (
	"os"
	"path/filepath"
	"testing"

	"github.com/lazyfork/lazyfork/memfile"
)

// A call of many forks consolidates early only where the copy replaces the
// pieces: the container alone holds the files it maps. A fork or a kept
// snapshot holding one of them keeps the pieces, and the copy would stay as
// one more heap; a holder of an older file the container left (it keeps its
// own reference until it goes, but maps it no more) does not.
func TestHeldAlone(t *testing.T) {
	store, err := memfile.OpenStore(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	const family = "fam"
	dir, err := store.FamilyDir(family)
	if err != nil {
		t.Fatal(err)
	}
	for _, f := range []string{"old" + memfile.FileExt, "cur" + memfile.FileExt, "patch" + memfile.FileExt} {
		if err := os.WriteFile(filepath.Join(dir, f), nil, 0o400); err != nil {
			t.Fatal(err)
		}
	}
	st := &containerState{Namespace: "ns", ID: "parent", Family: family}
	mapped := map[string]bool{"cur" + memfile.FileExt: true, "patch" + memfile.FileExt: true}
	alone := func() bool { return heldAlone(store, st, func(f string) bool { return mapped[f] }) }
	ref := func(holder string, files ...string) {
		t.Helper()
		for i := range files {
			files[i] += memfile.FileExt
		}
		if err := store.Ref(family, holder, files); err != nil {
			t.Fatal(err)
		}
	}
	if alone() {
		t.Fatal("alone on no files: there is nothing to consolidate")
	}
	ref(movedHolder("ns", "parent", "old"+memfile.FileExt), "old")
	ref(movedHolder("ns", "parent", "cur"+memfile.FileExt), "cur")
	ref(movedHolder("ns", "parent", "patch"+memfile.FileExt), "patch")
	if !alone() {
		t.Fatal("the parent alone holds its files: want alone")
	}
	// A fork of an earlier snapshot holds a file the parent held, but no
	// longer maps.
	ref(containerHolder("ns", "early-fork"), "old")
	if !alone() {
		t.Fatal("holders of a file the parent left count: want alone")
	}
	// A snapshot whose image is gone holds nothing.
	ref(memfile.HolderSnapshot+filepath.Join(t.TempDir(), "gone"), "cur")
	if !alone() {
		t.Fatal("a removed snapshot counts as a holder")
	}
	ref(containerHolder("ns", "fork"), "patch")
	if alone() {
		t.Fatal("a fork holds one of the files the parent maps: want not alone")
	}
	if err := store.Unref(family, containerHolder("ns", "fork")); err != nil {
		t.Fatal(err)
	}
	// The same name in another namespace is another container.
	ref(containerHolder("other", "parent"), "cur")
	if alone() {
		t.Fatal("a container of the parent's name in another namespace holds a file it maps: want not alone")
	}
}

// The rule for a call of many forks: the patches, once per fork, reach the
// bound, and are enough to be found fragmented; a single fork waits for the
// bound itself.
func TestDueForForks(t *testing.T) {
	for _, c := range []struct {
		patches, forks int
		moved, want    bool
	}{
		{patches: 580, forks: 100, moved: true, want: true},
		{patches: 580, forks: 1, moved: true, want: false},
		{patches: 580, forks: 100, moved: false, want: false}, // prepared already
		{patches: consolidateAfter / 2, forks: 2, moved: true, want: true},
		{patches: consolidateAfter/2 - 1, forks: 2, moved: true, want: false},
		{patches: consolidateAbove/2 - 1, forks: 1000, moved: true, want: false},
	} {
		n := &moveNote{patches: c.patches, moved: c.moved}
		if got := n.dueFor(c.forks); got != c.want {
			t.Errorf("%d patches, %d forks, moved %v: due %v, want %v", c.patches, c.forks, c.moved, got, c.want)
		}
	}
	if (*moveNote)(nil).dueFor(100) {
		t.Error("a container that never moved is due")
	}
}
