package memfile_test

import (
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/lazyfork/lazyfork/internal/testutil"
	"github.com/lazyfork/lazyfork/memfile"
	"golang.org/x/sys/unix"
)

// TestEnsureTmpfs mounts a tmpfs once: a second call finds it and mounts
// nothing more.
func TestEnsureTmpfs(t *testing.T) {
	testutil.RequiresRoot(t)
	dir := filepath.Join(t.TempDir(), "run", "lazyfork")
	t.Cleanup(func() {
		for unix.Unmount(dir, unix.MNT_DETACH) == nil {
		}
	})
	for i := 0; i < 2; i++ {
		if err := memfile.EnsureTmpfs(dir, 64<<20); err != nil {
			t.Fatal(err)
		}
	}
	if ok, err := memfile.IsTmpfs(dir); !ok || err != nil {
		t.Fatalf("not a tmpfs: %v", err)
	}
	b, _ := os.ReadFile("/proc/self/mountinfo")
	if n := strings.Count(string(b), " "+dir+" "); n != 1 {
		t.Fatalf("%d mounts at %s", n, dir)
	}
}
