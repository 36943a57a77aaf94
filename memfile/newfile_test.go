package memfile_test

import (
	"context"
	"os"
	"path/filepath"
	"testing"

	"github.com/lazyfork/lazyfork/memfile"
)

// storeWithFile opens a store in a fresh directory (root) and starts a file of
// family "fam" in it, a page written at 1 MiB.
func storeWithFile(t *testing.T) (root string, s *memfile.Store, pf *memfile.PendingFile) {
	t.Helper()
	root = t.TempDir()
	t.Cleanup(func() { memfile.RemoveAll(root) })
	s, err := memfile.OpenStore(root)
	if err != nil {
		t.Fatal(err)
	}
	if pf, err = s.CreateFile("fam"); err != nil {
		t.Fatal(err)
	}
	if _, err := pf.File().WriteAt([]byte("heap"), 1<<20); err != nil {
		t.Fatal(err)
	}
	return root, s, pf
}

// A file written outside a rewrite (a container's move): invisible to GC as a
// .tmp- file while written, then published for its holder, sealed where the
// filesystem can; one that is aborted after publishing goes once nothing maps
// it; where each file is charged is recorded and dropped with the file.
func TestPendingFile(t *testing.T) {
	root, s, pf := storeWithFile(t)
	ctx := context.Background()
	if freed, err := s.GC(ctx); err != nil || len(freed) != 0 {
		t.Fatalf("GC while the file is written: freed %v, %v", freed, err)
	}
	if err := pf.Publish("moved:ns/c/" + pf.Name()); err != nil {
		t.Fatal(err)
	}
	if err := pf.Seal(); err != nil {
		t.Fatal(err)
	}
	if err := s.SetCharge("fam", pf.Name(), "/ns/c"); err != nil {
		t.Fatal(err)
	}
	if err := s.Verify("fam", []string{pf.Name()}); err != nil {
		t.Errorf("a sealed, published file: %v", err)
	}
	if h, _ := s.Holders("fam"); len(h["moved:ns/c/"+pf.Name()]) != 1 {
		t.Errorf("holders %v, want the mover's", h)
	}
	if ch, _ := s.Charges("fam"); ch[pf.Name()] != "/ns/c" {
		t.Errorf("charges %v", ch)
	}

	aborted, err := s.CreateFile("fam")
	if err != nil {
		t.Fatal(err)
	}
	if err := aborted.Publish("moved:ns/c/" + aborted.Name()); err != nil {
		t.Fatal(err)
	}
	aborted.Abort()
	if _, err := os.Stat(filepath.Join(root, "fam", aborted.Name())); !os.IsNotExist(err) {
		t.Errorf("an aborted file nothing maps is still there: %v", err)
	}

	if err := s.Unref("fam", "moved:ns/c/"+pf.Name()); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(filepath.Join(root, "fam", pf.Name())); !os.IsNotExist(err) {
		t.Errorf("the file outlived its last holder: %v", err)
	}
	if ch, _ := s.Charges("fam"); len(ch) != 0 {
		t.Errorf("charge records outlived their files: %v", ch)
	}
}
