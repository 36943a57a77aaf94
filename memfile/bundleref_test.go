package memfile_test

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"slices"
	"testing"

	"github.com/containerd/errdefs"

	"github.com/lazyfork/lazyfork/memfile"
)

// TestRefBundle: a container's reference tied to its task bundle lives while
// the bundle does; once containerd removed the bundle without a delete (a
// shim that died while creating the task), GC drops the reference, removes
// the container's view and frees the file only they pinned. A reference of
// the same container made again (its task created anew) is alive again. A
// bundle whose task root is not seen at all (another mount namespace) keeps
// its reference.
func TestRefBundle(t *testing.T) {
	root, s, pf := storeWithFile(t)
	ctx := context.Background()
	if err := pf.Publish("snapshot:/nowhere"); err != nil { // a dead holder: GC drops it
		t.Fatal(err)
	}
	file := pf.Name()
	holder := memfile.HolderContainer + "ns/c1"
	bundle := filepath.Join(t.TempDir(), "ns", "c1")
	if err := os.MkdirAll(bundle, 0o700); err != nil {
		t.Fatal(err)
	}
	if err := s.RefBundle("fam", holder, bundle, []string{file}); err != nil {
		t.Fatal(err)
	}
	view := memfile.ViewName("ns", "c1")
	if _, err := s.LinkView("fam", view, []string{file}); err != nil {
		t.Fatal(err)
	}
	exists := func(p string) bool { _, err := os.Lstat(p); return err == nil }
	famFile := filepath.Join(root, "fam", file)

	if freed, err := s.GC(ctx); err != nil || len(freed) != 0 || !exists(famFile) || !exists(s.ViewDir(view)) {
		t.Fatalf("GC with the bundle in place: freed %v (%v); file %v, view %v", freed, err, exists(famFile), exists(s.ViewDir(view)))
	}
	if h, _ := s.Holders("fam"); !slices.Equal(h[holder], []string{file}) {
		t.Fatalf("holders %v, want %s holding %s", h, holder, file)
	}

	// Made again while the bundle is there: the same, alive reference.
	if err := s.RefBundle("fam", holder, bundle, []string{file}); err != nil {
		t.Fatal(err)
	}
	if err := os.RemoveAll(bundle); err != nil {
		t.Fatal(err)
	}
	freed, err := s.GC(ctx)
	if err != nil || !slices.Equal(freed, []string{file}) {
		t.Fatalf("GC after the bundle went: freed %v (%v), want %s", freed, err, file)
	}
	if exists(famFile) || exists(s.ViewDir(view)) {
		t.Errorf("after GC: file %v, view %v; want both gone", exists(famFile), exists(s.ViewDir(view)))
	}
	if h, _ := s.Holders("fam"); len(h) != 0 {
		t.Errorf("holders %v after GC, want none", h)
	}

	// Its task root unseen: alive, whatever the bundle.
	unseen := memfile.HolderContainer + "ns/c2"
	if err := s.RefBundle("fam", unseen, "/nonexistent-task-root/ns/c2", nil); err != nil {
		t.Fatal(err)
	}
	if _, err := s.GC(ctx); err != nil {
		t.Fatal(err)
	}
	if h, _ := s.Holders("fam"); !mapHas(h, unseen) {
		t.Errorf("holders %v: %s dropped though its task root is not seen", h, unseen)
	}

	for _, bad := range []struct{ holder, bundle string }{
		{"snapshot:/x", bundle}, {holder, "relative/dir"}, {memfile.HolderContainer + "nsonly", bundle},
	} {
		if err := s.RefBundle("fam", bad.holder, bad.bundle, nil); !errors.Is(err, errdefs.ErrInvalidArgument) {
			t.Errorf("RefBundle(%q, %q): %v, want invalid argument", bad.holder, bad.bundle, err)
		}
	}
}

func mapHas[V any](m map[string]V, k string) bool { _, ok := m[k]; return ok }
