package memfile_test

import (
	"os"
	"path/filepath"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/lazyfork/lazyfork/memfile"
)

// MappedBy finds a file a process maps, by device and inode, and no other;
// a file it cannot stat counts as mapped.
func TestMappedBy(t *testing.T) {
	dir := t.TempDir()
	mapped, other := filepath.Join(dir, "mapped"), filepath.Join(dir, "other")
	for _, p := range []string{mapped, other} {
		if err := os.WriteFile(p, make([]byte, 4096), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	f, err := os.Open(mapped)
	if err != nil {
		t.Fatal(err)
	}
	m, err := unix.Mmap(int(f.Fd()), 0, 4096, unix.PROT_READ, unix.MAP_PRIVATE)
	f.Close()
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Munmap(m)
	self := []int{os.Getpid()}
	if !memfile.MappedBy(self, mapped) {
		t.Error("a file this process maps is not found mapped")
	}
	if memfile.MappedBy(self, other) {
		t.Error("a file no process maps is found mapped")
	}
	if !memfile.MappedBy(self, filepath.Join(dir, "gone")) {
		t.Error("a file that cannot be stat'ed does not count as mapped")
	}
}
