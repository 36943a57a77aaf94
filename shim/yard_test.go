package shim

import (
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/lazyfork/lazyfork/internal/testutil"
)

// A CRIU killed mid-restore leaves its cgroup yard mounted in the task's work
// directory; the shim unmounts it (and only the yard of that container).
func TestUnmountCRIUYard(t *testing.T) {
	testutil.RequiresRoot(t)
	dir := t.TempDir()
	yard := filepath.Join(dir, "fork-1", ".criu.cgyard.AbC123")
	other := filepath.Join(dir, "fork-10", ".criu.cgyard.XyZ")
	for _, d := range []string{yard, other} {
		if err := os.MkdirAll(d, 0o700); err != nil {
			t.Fatal(err)
		}
		if err := unix.Mount("yard", d, "tmpfs", 0, ""); err != nil {
			t.Fatal(err)
		}
		os.Mkdir(filepath.Join(d, "memory"), 0o700)
		if err := unix.Mount("yard", filepath.Join(d, "memory"), "tmpfs", 0, ""); err != nil {
			t.Fatal(err)
		}
	}
	t.Cleanup(func() {
		unix.Unmount(filepath.Join(other, "memory"), unix.MNT_DETACH)
		unix.Unmount(other, unix.MNT_DETACH)
	})
	unmountCRIUYard(context.Background(), "fork-1")
	b, _ := os.ReadFile("/proc/self/mountinfo")
	if strings.Contains(string(b), yard) {
		t.Errorf("yard of fork-1 still mounted")
	}
	if !strings.Contains(string(b), other) {
		t.Errorf("the yard of another container was unmounted")
	}
}
