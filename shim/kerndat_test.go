package shim

import (
	"os"
	"path/filepath"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/lazyfork/lazyfork/internal/testutil"
)

// TestMain lets the test binary stand in for the shim binary as the
// kerndat helper (RunHook), as the shim re-executes itself.
func TestMain(m *testing.M) {
	if len(os.Args) > 2 && os.Args[1] == HookArg && os.Args[2] == kerndatHelperArg {
		os.Exit(RunHook(os.Args[2:]))
	}
	os.Exit(m.Run())
}

// TestKerndatCache: on a host whose run directory is on a disk, the shim
// gives CRIU a kernel-feature cache on LazyFork's tmpfs through a link, leaves
// someone else's regular file alone, and replaces a link left dangling by a
// gone root.
func TestKerndatCache(t *testing.T) {
	testutil.RequiresCRIU(t)
	run := t.TempDir() // on the test machine's disk, like this host's /run
	if ok, _ := isTmpfsDir(run); ok {
		t.Skip("the temporary directory is a tmpfs: CRIU keeps its own cache there")
	}
	old := kerndatLink
	kerndatLink = filepath.Join(run, "criu.kdat")
	t.Cleanup(func() { kerndatLink = old })
	self, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	root := t.TempDir()

	if err := ensureKerndatCache(root, self); err != nil {
		t.Fatal(err)
	}
	target, err := os.Readlink(kerndatLink)
	if err != nil {
		t.Fatalf("no link at %s: %v", kerndatLink, err)
	}
	if filepath.Dir(target) != root {
		t.Fatalf("link points at %s, want a file in %s", target, root)
	}
	b, err := os.ReadFile(kerndatLink)
	if err != nil || len(b) < 64 {
		t.Fatalf("cache through the link: %d bytes, %v", len(b), err)
	}

	// A gone root: the dangling link is replaced by one to a new cache.
	root2 := t.TempDir()
	if err := os.Remove(target); err != nil {
		t.Fatal(err)
	}
	if err := ensureKerndatCache(root2, self); err != nil {
		t.Fatal(err)
	}
	if got, _ := os.Readlink(kerndatLink); filepath.Dir(got) != root2 {
		t.Fatalf("after the root went: link points at %q, want a file in %s", got, root2)
	}
	if b2, err := os.ReadFile(kerndatLink); err != nil || len(b2) != len(b) {
		t.Fatalf("new cache: %d bytes, %v (first was %d)", len(b2), err, len(b))
	}

	// Someone else's regular file is theirs.
	if err := os.Remove(kerndatLink); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(kerndatLink, []byte("theirs"), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := ensureKerndatCache(root, self); err != nil {
		t.Fatal(err)
	}
	if b, _ := os.ReadFile(kerndatLink); string(b) != "theirs" {
		t.Fatalf("a regular %s was replaced", kerndatLink)
	}
}

func isTmpfsDir(dir string) (bool, error) {
	var fs unix.Statfs_t
	if err := unix.Statfs(dir, &fs); err != nil {
		return false, err
	}
	return fs.Type == unix.TMPFS_MAGIC, nil
}
