package memfile_test

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/containerd/errdefs"
	"github.com/lazyfork/lazyfork/internal/testutil"
	"github.com/lazyfork/lazyfork/memfile"
	"golang.org/x/sys/unix"
)

// tmpfsStore opens a store on a private tmpfs (root: tmpfs supports the
// immutable attribute, and sealing needs CAP_LINUX_IMMUTABLE).
func tmpfsStore(t *testing.T) *memfile.Store {
	t.Helper()
	testutil.RequiresRoot(t)
	root := filepath.Join(t.TempDir(), "mem")
	if err := memfile.EnsureTmpfs(root, 64<<20); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { unix.Unmount(root, unix.MNT_DETACH) })
	s, err := memfile.OpenStore(root)
	if err != nil {
		t.Fatal(err)
	}
	return s
}

// sealed reads the immutable flag (FS_IMMUTABLE_FL) of path.
func sealed(t *testing.T, path string) bool {
	t.Helper()
	f, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	flags, err := unix.IoctlGetUint32(int(f.Fd()), unix.FS_IOC_GETFLAGS)
	if err != nil {
		t.Fatalf("FS_IOC_GETFLAGS %s: %v", path, err)
	}
	return flags&0x10 != 0
}

// memFile makes a family file the way a rewrite leaves it: data, 0400, sealed.
func memFile(t *testing.T, s *memfile.Store, family, name string) string {
	t.Helper()
	dir, err := s.FamilyDir(family)
	if err != nil {
		t.Fatal(err)
	}
	p := filepath.Join(dir, name)
	if err := os.WriteFile(p, []byte("memory of "+name), 0o400); err != nil {
		t.Fatal(err)
	}
	if err := memfile.Seal(p); err != nil {
		t.Fatal(err)
	}
	return p
}

// assertSealed checks that nobody, root included, can change path.
func assertSealed(t *testing.T, path string) {
	t.Helper()
	if !sealed(t, path) {
		t.Fatalf("%s is not immutable", path)
	}
	if f, err := os.OpenFile(path, os.O_WRONLY, 0); !errors.Is(err, unix.EPERM) {
		if err == nil {
			f.Close()
		}
		t.Errorf("open %s for writing: %v, want EPERM", path, err)
	}
	if err := os.Truncate(path, 0); !errors.Is(err, unix.EPERM) {
		t.Errorf("truncate %s: %v, want EPERM", path, err)
	}
	if err := os.Remove(path); !errors.Is(err, unix.EPERM) {
		t.Errorf("unlink %s: %v, want EPERM", path, err)
	}
	if err := os.Chmod(path, 0o600); !errors.Is(err, unix.EPERM) {
		t.Errorf("chmod %s: %v, want EPERM", path, err)
	}
}

// TestRewriteSeals: the memory file of a real rewrite is immutable (no
// write, truncation or unlink, even by root), still restores, passes
// Verify, and is freed by GC once unreferenced.
func TestRewriteSeals(t *testing.T) {
	testutil.RequiresRoot(t)
	e := newEnv(t)
	dir := e.dump(e.start(8, 1))
	res := e.rewrite(dir)
	if len(res.Files) != 1 {
		t.Fatalf("files %v", res.Files)
	}
	file := filepath.Join(e.famDir, res.Files[0])
	assertSealed(t, file)
	if err := e.store.Verify(e.family, res.Files); err != nil {
		t.Fatal(err)
	}
	copyPID := e.restore(dir)
	e.verifyTree(copyPID)
	kill(copyPID)
	if err := os.RemoveAll(dir); err != nil {
		t.Fatal(err)
	}
	freed, err := e.store.GC(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	if !slices.Equal(freed, res.Files) {
		t.Fatalf("GC freed %v, want %v", freed, res.Files)
	}
	if _, err := os.Lstat(file); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("sealed file not freed: %v", err)
	}
}

// TestGCFreesSealed: GC frees an unreferenced sealed file; one that a view
// still links leaves the family but stays sealed in the view.
func TestGCFreesSealed(t *testing.T) {
	s := tmpfsStore(t)
	a := memFile(t, s, "fam", "a.mem")
	memFile(t, s, "fam", "b.mem")
	view, err := s.LinkView("fam", "v1", []string{"b.mem"})
	if err != nil {
		t.Fatal(err)
	}
	freed, err := s.GC(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	if !slices.Equal(freed, []string{"a.mem", "b.mem"}) {
		t.Fatalf("freed %v", freed)
	}
	if _, err := os.Lstat(a); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("a.mem: %v", err)
	}
	assertSealed(t, filepath.Join(view, "b.mem"))
}

// TestVerify: Verify passes a sealed file and names what is wrong with a
// file whose seal was cleared, whose mode changed, that was truncated or
// removed.
func TestVerify(t *testing.T) {
	s := tmpfsStore(t)
	p := memFile(t, s, "fam", "a.mem")
	if err := s.Verify("fam", []string{"a.mem"}); err != nil {
		t.Fatal(err)
	}
	check := func(want string) {
		t.Helper()
		err := s.Verify("fam", []string{"a.mem"})
		if !errors.Is(err, errdefs.ErrDataLoss) || !strings.Contains(err.Error(), "a.mem") || !strings.Contains(err.Error(), want) {
			t.Fatalf("Verify: %v, want ErrDataLoss naming a.mem and %q", err, want)
		}
	}
	if err := memfile.Unseal(p); err != nil {
		t.Fatal(err)
	}
	check("is not immutable")
	if err := os.Chmod(p, 0o600); err != nil {
		t.Fatal(err)
	}
	check("mode 0600")
	if err := os.Chmod(p, 0o400); err != nil {
		t.Fatal(err)
	}
	if err := os.Truncate(p, 0); err != nil {
		t.Fatal(err)
	}
	check("empty")
	if err := os.Remove(p); err != nil {
		t.Fatal(err)
	}
	check("missing")
	if err := s.Verify("fam", []string{"../x.mem"}); !errdefs.IsInvalidArgument(err) {
		t.Fatalf("bad name: %v", err)
	}
}

// TestRemoveAll: a tree holding sealed files and a sealed directory, which
// os.RemoveAll cannot remove, goes; a file linked from outside the tree
// keeps its seal.
func TestRemoveAll(t *testing.T) {
	testutil.RequiresRoot(t)
	tmp := t.TempDir()
	tree := filepath.Join(tmp, "tree")
	sub := filepath.Join(tree, "sub")
	if err := os.MkdirAll(sub, 0o755); err != nil {
		t.Fatal(err)
	}
	for _, p := range []string{filepath.Join(tree, "a.mem"), filepath.Join(sub, "b.mem")} {
		if err := os.WriteFile(p, []byte("x"), 0o400); err != nil {
			t.Fatal(err)
		}
	}
	outside := filepath.Join(tmp, "outside.mem")
	if err := os.Link(filepath.Join(sub, "b.mem"), outside); err != nil {
		t.Fatal(err)
	}
	for _, p := range []string{filepath.Join(tree, "a.mem"), filepath.Join(sub, "b.mem"), sub} {
		if err := memfile.Seal(p); err != nil {
			t.Fatal(err)
		}
	}
	t.Cleanup(func() { memfile.RemoveAll(tmp) })
	if !sealed(t, sub) {
		t.Skipf("%s cannot seal files", tmp)
	}
	if err := os.RemoveAll(tree); !errors.Is(err, unix.EPERM) {
		t.Fatalf("os.RemoveAll of sealed files: %v, want EPERM", err)
	}
	if err := memfile.RemoveAll(tree); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Lstat(tree); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("tree left: %v", err)
	}
	assertSealed(t, outside)
	if err := memfile.RemoveAll(filepath.Join(tmp, "absent")); err != nil {
		t.Fatal(err)
	}
}

func dirNames(t *testing.T, dir string) []string {
	t.Helper()
	ents, err := os.ReadDir(dir)
	if err != nil {
		t.Fatal(err)
	}
	var out []string
	for _, e := range ents {
		out = append(out, e.Name())
	}
	return out
}

func sameInode(t *testing.T, a, b string) bool {
	t.Helper()
	var sa, sb unix.Stat_t
	if err := unix.Stat(a, &sa); err != nil {
		t.Fatal(err)
	}
	if err := unix.Stat(b, &sb); err != nil {
		t.Fatal(err)
	}
	return sa.Dev == sb.Dev && sa.Ino == sb.Ino
}

// TestViews: a view holds exactly the files linked into it, sharing their
// inodes (and page cache) with the family's files; a file the family gets
// later does not appear in it; a file someone else put in the view does not
// disturb it; RemoveView removes it and the family's files stay sealed.
func TestViews(t *testing.T) {
	s := tmpfsStore(t)
	famDir, _ := s.FamilyDir("fam")
	memFile(t, s, "fam", "a.mem")
	memFile(t, s, "fam", "b.mem")
	memFile(t, s, "fam", "c.mem") // a sibling's delta
	// The container's holder pins the files, as the shim's does.
	if err := s.Ref("fam", "container:ns1/c1", []string{"a.mem", "b.mem", "c.mem"}); err != nil {
		t.Fatal(err)
	}
	view := memfile.ViewName("ns1", "c1")
	if view == memfile.ViewName("ns2", "c1") || view == memfile.ViewName("ns1", "c2") || len(view) != 32 {
		t.Fatalf("view names: %s %s %s", view, memfile.ViewName("ns2", "c1"), memfile.ViewName("ns1", "c2"))
	}
	dir, err := s.LinkView("fam", view, []string{"a.mem"})
	if err != nil {
		t.Fatal(err)
	}
	if dir != s.ViewDir(view) || dir != filepath.Join(s.Root(), ".views", view) {
		t.Fatalf("view dir %s", dir)
	}
	// The shim's file in the view.
	if err := os.WriteFile(filepath.Join(dir, "vm.overcommit_memory.1"), []byte("1\n"), 0o444); err != nil {
		t.Fatal(err)
	}
	d := memFile(t, s, "fam", "d.mem") // a sibling's later delta
	if err := s.Ref("fam", "container:ns1/c2", []string{"d.mem"}); err != nil {
		t.Fatal(err)
	}
	if _, err := s.LinkView("fam", view, []string{"a.mem"}); err != nil {
		t.Fatalf("LinkView again: %v", err)
	}
	if got := dirNames(t, dir); !slices.Equal(got, []string{"a.mem", "vm.overcommit_memory.1"}) {
		t.Fatalf("view holds %v", got)
	}
	for _, f := range []string{"c.mem", "d.mem"} {
		if _, err := os.Stat(filepath.Join(dir, f)); !errors.Is(err, os.ErrNotExist) {
			t.Fatalf("a sibling's file %s is visible in the view: %v", f, err)
		}
	}
	assertSealed(t, d)
	if !sameInode(t, filepath.Join(dir, "a.mem"), filepath.Join(famDir, "a.mem")) {
		t.Fatal("the view's link is another inode than the family file")
	}
	assertSealed(t, filepath.Join(dir, "a.mem"))
	// A fork of this container adds its parent's file.
	if _, err := s.LinkView("fam", view, []string{"a.mem", "b.mem"}); err != nil {
		t.Fatal(err)
	}
	if got := dirNames(t, dir); !slices.Equal(got, []string{"a.mem", "b.mem", "vm.overcommit_memory.1"}) {
		t.Fatalf("view holds %v", got)
	}
	if _, err := s.LinkView("fam", view, []string{"zz.mem"}); !errdefs.IsNotFound(err) {
		t.Fatalf("missing file: %v", err)
	}
	if _, err := s.LinkView("fam", "../x", nil); !errdefs.IsInvalidArgument(err) {
		t.Fatalf("bad view name: %v", err)
	}
	if err := s.RemoveView(view); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Lstat(dir); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("view left: %v", err)
	}
	assertSealed(t, filepath.Join(famDir, "a.mem"))
	assertSealed(t, filepath.Join(famDir, "b.mem"))
	if err := s.RemoveView(view); err != nil {
		t.Fatalf("RemoveView of an absent view: %v", err)
	}
	// GC skips the views directory.
	if _, err := s.LinkView("fam", view, []string{"a.mem"}); err != nil {
		t.Fatal(err)
	}
	if _, err := s.GC(context.Background()); err != nil {
		t.Fatal(err)
	}
	if got := dirNames(t, dir); !slices.Equal(got, []string{"a.mem"}) {
		t.Fatalf("view after GC holds %v", got)
	}
}

// TestClaim: a family belongs to the namespace that claimed it first; the
// record goes once the family has no files, holders or views.
func TestClaim(t *testing.T) {
	s, err := memfile.OpenStore(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	if _, err := s.Owner("fam"); !errdefs.IsNotFound(err) {
		t.Fatalf("owner of a new family: %v", err)
	}
	if err := s.Claim("fam", memfile.Owner{Namespace: "ns1", Root: "parent"}); err != nil {
		t.Fatal(err)
	}
	if err := s.Claim("fam", memfile.Owner{Namespace: "ns1", Root: "other"}); err != nil {
		t.Fatalf("same namespace: %v", err)
	}
	err = s.Claim("fam", memfile.Owner{Namespace: "ns2", Root: "intruder"})
	if !errdefs.IsAlreadyExists(err) || !strings.Contains(err.Error(), `"ns1"`) || !strings.Contains(err.Error(), `"ns2"`) {
		t.Fatalf("other namespace: %v", err)
	}
	o, err := s.Owner("fam")
	if err != nil || o.Namespace != "ns1" || o.Root != "parent" || o.Created.IsZero() {
		t.Fatalf("owner %+v, %v", o, err)
	}
	if err := s.Claim("fam", memfile.Owner{}); !errdefs.IsInvalidArgument(err) {
		t.Fatalf("empty namespace: %v", err)
	}

	// A holder (even of no files) keeps the family and its owner.
	if err := s.Ref("fam", "container:ns1/parent", nil); err != nil {
		t.Fatal(err)
	}
	if _, err := s.GC(context.Background()); err != nil {
		t.Fatal(err)
	}
	if _, err := s.Owner("fam"); err != nil {
		t.Fatalf("owner of a held family: %v", err)
	}
	// So does a view.
	if _, err := s.LinkView("fam", "v1", nil); err != nil {
		t.Fatal(err)
	}
	if err := s.Unref("fam", "container:ns1/parent"); err != nil {
		t.Fatal(err)
	}
	if _, err := s.Owner("fam"); err != nil {
		t.Fatalf("owner of a family with a view: %v", err)
	}
	if err := s.RemoveView("v1"); err != nil {
		t.Fatal(err)
	}
	if _, err := s.Owner("fam"); !errdefs.IsNotFound(err) {
		t.Fatalf("owner of an empty family: %v", err)
	}
	for _, d := range []string{filepath.Join(s.Root(), "fam"), filepath.Join(s.Root(), ".state", "fam")} {
		if _, err := os.Lstat(d); !errors.Is(err, os.ErrNotExist) {
			t.Errorf("empty family left %s: %v", d, err)
		}
	}
	// Now anyone may start it.
	if err := s.Claim("fam", memfile.Owner{Namespace: "ns2", Root: "new"}); err != nil {
		t.Fatal(err)
	}
	if _, err := s.GC(context.Background()); err != nil {
		t.Fatal(err)
	}
	if _, err := s.Owner("fam"); !errdefs.IsNotFound(err) {
		t.Fatalf("GC kept the owner of an empty family: %v", err)
	}
}

// TestFamilyLockAcrossRemoval: GC removing an empty family's state (its lock
// file too) never lets a change slip through unlocked: every holder recorded
// while GCs run is there afterwards.
func TestFamilyLockAcrossRemoval(t *testing.T) {
	s, err := memfile.OpenStore(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	stop := make(chan struct{})
	gcDone := make(chan error)
	go func() {
		for {
			select {
			case <-stop:
				gcDone <- nil
				return
			default:
			}
			if _, err := s.GC(context.Background()); err != nil {
				gcDone <- err
				return
			}
		}
	}()
	errs := make(chan error, 4)
	for w := 0; w < 4; w++ {
		go func(w int) {
			for i := 0; i < 200; i++ {
				h := "container:ns/" + strings.Repeat("x", w+1)
				if err := s.Ref("fam", h, nil); err != nil {
					errs <- err
					return
				}
				hs, err := s.Holders("fam")
				if err != nil {
					errs <- err
					return
				}
				if _, ok := hs[h]; !ok {
					errs <- errors.New("a holder recorded under the lock vanished: " + h)
					return
				}
				if err := s.Unref("fam", h); err != nil {
					errs <- err
					return
				}
			}
			errs <- nil
		}(w)
	}
	for w := 0; w < 4; w++ {
		if err := <-errs; err != nil {
			t.Error(err)
		}
	}
	close(stop)
	if err := <-gcDone; err != nil {
		t.Fatal(err)
	}
}

// TestSealAnywhere: on a t.TempDir, sealed where the caller can (root on
// ext4) or not at all (non-root): memory files made and sealed there pass
// Verify, link into views, and the directory can be cleaned up.
func TestSealAnywhere(t *testing.T) {
	tmp := t.TempDir()
	t.Cleanup(func() {
		if err := memfile.RemoveAll(tmp); err != nil {
			t.Error(err)
		}
	})
	s, err := memfile.OpenStore(tmp)
	if err != nil {
		t.Fatal(err)
	}
	famDir, _ := s.FamilyDir("fam")
	memFile(t, s, "fam", "a.mem")
	memFile(t, s, "fam", "b.mem")
	if err := s.Verify("fam", []string{"a.mem", "b.mem"}); err != nil {
		t.Fatal(err)
	}
	if err := s.Ref("fam", "container:ns/c", []string{"a.mem"}); err != nil {
		t.Fatal(err)
	}
	view, err := s.LinkView("fam", memfile.ViewName("ns", "c"), []string{"a.mem"})
	if err != nil {
		t.Fatal(err)
	}
	if got := dirNames(t, view); !slices.Equal(got, []string{"a.mem"}) || !sameInode(t, filepath.Join(view, "a.mem"), filepath.Join(famDir, "a.mem")) {
		t.Fatalf("view holds %v", got)
	}
	if freed, err := s.GC(context.Background()); err != nil || !slices.Equal(freed, []string{"b.mem"}) {
		t.Fatalf("GC freed %v: %v", freed, err)
	}
	if err := s.RemoveView(memfile.ViewName("ns", "c")); err != nil {
		t.Fatal(err)
	}
	if err := s.Verify("fam", []string{"a.mem"}); err != nil {
		t.Fatal(err)
	}
}
