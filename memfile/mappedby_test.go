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

// UnmappedData counts a file's allocated pages that no process maps: not
// holes, not what a mapping covers.
func TestUnmappedData(t *testing.T) {
	const page = 4096
	path := filepath.Join(t.TempDir(), "mem")
	f, err := os.Create(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	for _, i := range []int64{0, 1, 2, 4} { // page 3 a hole
		if _, err := f.WriteAt(make([]byte, page), i*page); err != nil {
			t.Fatal(err)
		}
	}
	if n, err := memfile.UnmappedData([]string{path}); err != nil || n != 4*page {
		t.Fatalf("nothing mapped: %d bytes, %v; want %d", n, err, 4*page)
	}
	m, err := unix.Mmap(int(f.Fd()), page, 3*page, unix.PROT_READ, unix.MAP_PRIVATE) // pages 1-3
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Munmap(m)
	if n, err := memfile.UnmappedData([]string{path}); err != nil || n != 2*page {
		t.Fatalf("pages 1-3 mapped: %d bytes unmapped, %v; want %d (pages 0 and 4)", n, err, 2*page)
	}
}
