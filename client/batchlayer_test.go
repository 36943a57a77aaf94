//go:build linux

package client

import (
	"os"
	"path/filepath"
	"sort"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/lazyfork/lazyfork/internal/testutil"
)

// A fork's writable layer copied together with its batch layer reads as the
// overlay of the two: the upper's files, whiteouts, opaque directories and
// type changes win over the batch layer's.
func TestCopyLayersIsTheOverlay(t *testing.T) {
	testutil.RequiresRoot(t) // whiteouts are device nodes, opaque marks trusted xattrs
	lower, upper, dst := t.TempDir(), t.TempDir(), filepath.Join(t.TempDir(), "upper")
	write := func(p, s string) {
		t.Helper()
		if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(p, []byte(s), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	whiteout := func(p string) {
		t.Helper()
		if err := unix.Mknod(p, unix.S_IFCHR, 0); err != nil {
			t.Fatal(err)
		}
	}
	// The batch layer: what the parent wrote.
	write(filepath.Join(lower, "kept"), "parent")
	write(filepath.Join(lower, "changed"), "parent")
	write(filepath.Join(lower, "deleted"), "parent")
	write(filepath.Join(lower, "dir/old"), "parent")
	write(filepath.Join(lower, "opaque/old"), "parent")
	write(filepath.Join(lower, "dirtofile/x"), "parent")
	write(filepath.Join(lower, "filetodir"), "parent")
	// The fork's upper over it.
	write(filepath.Join(upper, "changed"), "fork")
	whiteout(filepath.Join(upper, "deleted"))
	write(filepath.Join(upper, "dir/new"), "fork")
	write(filepath.Join(upper, "opaque/new"), "fork")
	if err := unix.Setxattr(filepath.Join(upper, "opaque"), "trusted.overlay.opaque", []byte("y"), 0); err != nil {
		t.Skipf("trusted xattrs: %v", err)
	}
	write(filepath.Join(upper, "dirtofile"), "fork")
	write(filepath.Join(upper, "filetodir/y"), "fork")
	write(filepath.Join(upper, "added"), "fork")

	if err := copyLayers(dst, lower, upper); err != nil {
		t.Fatal(err)
	}
	got := map[string]string{}
	err := filepath.Walk(dst, func(p string, fi os.FileInfo, err error) error {
		if err != nil || p == dst {
			return err
		}
		rel, _ := filepath.Rel(dst, p)
		switch {
		case fi.IsDir():
			got[rel] = "dir"
			if opaqueDir(p) {
				got[rel] = "opaque dir"
			}
		case fi.Mode()&os.ModeCharDevice != 0:
			got[rel] = "whiteout"
		default:
			b, err := os.ReadFile(p)
			if err != nil {
				return err
			}
			got[rel] = string(b)
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	want := map[string]string{
		"kept": "parent", "changed": "fork", "deleted": "whiteout", "added": "fork",
		"dir": "dir", "dir/old": "parent", "dir/new": "fork",
		"opaque": "opaque dir", "opaque/new": "fork",
		"dirtofile": "fork", "filetodir": "dir", "filetodir/y": "fork",
	}
	var keys []string
	for k := range want {
		keys = append(keys, k)
	}
	for k := range got {
		if _, ok := want[k]; !ok {
			keys = append(keys, k)
		}
	}
	sort.Strings(keys)
	for _, k := range keys {
		if got[k] != want[k] {
			t.Errorf("%s: %q, want %q", k, got[k], want[k])
		}
	}
}
