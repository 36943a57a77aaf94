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

// A restore killed midway leaves CRIU's cgroup yard mounted in the task's work
// directory and runc's criu-root in its state directory; the shim unmounts
// them, and only those of that container.
func TestUnmountRestoreLeftovers(t *testing.T) {
	testutil.RequiresRoot(t)
	dir := t.TempDir()
	yard := filepath.Join(dir, "fork-1", ".criu.cgyard.AbC123")
	other := filepath.Join(dir, "fork-10", ".criu.cgyard.XyZ")
	criuRoot := filepath.Join(dir, "runc", "ns", "fork-1", "criu-root")
	otherRoot := filepath.Join(dir, "runc", "ns2", "fork-1", "criu-root")
	for _, d := range []string{criuRoot, otherRoot} {
		if err := os.MkdirAll(d, 0o700); err != nil {
			t.Fatal(err)
		}
		if err := unix.Mount("/", d, "", unix.MS_BIND, ""); err != nil {
			t.Fatal(err)
		}
	}
	t.Cleanup(func() { unix.Unmount(otherRoot, unix.MNT_DETACH) })
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
	unmountRestoreLeftovers(context.Background(), "ns", "fork-1")
	b, _ := os.ReadFile("/proc/self/mountinfo")
	if strings.Contains(string(b), yard) || strings.Contains(string(b), criuRoot+" ") {
		t.Errorf("the yard or criu-root of ns/fork-1 still mounted")
	}
	if !strings.Contains(string(b), other) || !strings.Contains(string(b), otherRoot+" ") {
		t.Errorf("another container's yard or criu-root was unmounted")
	}
}
