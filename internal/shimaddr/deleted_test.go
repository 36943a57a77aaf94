//go:build linux

package shimaddr

import (
	"bytes"
	"os"
	"path/filepath"
	"testing"
	"time"
)

// A recorded delete is read back only from a regular file with one link,
// small enough and not older than the bundle's spec (a bundle made again for
// a task with the same id).
func TestDeleted(t *testing.T) {
	bundle := t.TempDir()
	spec := filepath.Join(bundle, SpecFile)
	if err := os.WriteFile(spec, []byte("{}"), 0o600); err != nil {
		t.Fatal(err)
	}
	if _, ok := ReadDeleted(bundle); ok {
		t.Fatal("a bundle without a record: read one")
	}
	resp := []byte{0x08, 0x2a, 0x10, 0x89, 0x01} // pid 42, status 137
	if err := WriteDeleted(bundle, resp); err != nil {
		t.Fatal(err)
	}
	if got, ok := ReadDeleted(bundle); !ok || !bytes.Equal(got, resp) {
		t.Fatalf("read back % x (%v), want % x", got, ok, resp)
	}
	empty := t.TempDir()
	if err := os.WriteFile(filepath.Join(empty, DeletedFile), resp, 0o600); err != nil {
		t.Fatal(err)
	}
	if _, ok := ReadDeleted(empty); ok {
		t.Error("a record in a bundle without a spec: trusted")
	}

	path := filepath.Join(bundle, DeletedFile)
	future := time.Now().Add(time.Hour)
	if err := os.Chtimes(spec, future, future); err != nil {
		t.Fatal(err)
	}
	if _, ok := ReadDeleted(bundle); ok {
		t.Error("a record older than the spec (a bundle made again): trusted")
	}
	if err := os.Chtimes(spec, time.Unix(0, 0), time.Unix(0, 0)); err != nil {
		t.Fatal(err)
	}

	link := filepath.Join(bundle, "other")
	if err := os.Link(path, link); err != nil {
		t.Fatal(err)
	}
	if _, ok := ReadDeleted(bundle); ok {
		t.Error("a record with two links: trusted")
	}
	os.Remove(link)

	if err := os.WriteFile(path, make([]byte, maxDeleted+1), 0o600); err != nil {
		t.Fatal(err)
	}
	if _, ok := ReadDeleted(bundle); ok {
		t.Error("a record larger than a DeleteResponse: trusted")
	}

	os.Remove(path)
	target := filepath.Join(t.TempDir(), "target")
	if err := os.WriteFile(target, resp, 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink(target, path); err != nil {
		t.Fatal(err)
	}
	if _, ok := ReadDeleted(bundle); ok {
		t.Error("a symlink: followed")
	}
}
