//go:build linux

package node

import (
	"os"
	"path/filepath"
	"testing"

	"golang.org/x/sys/unix"
)

// A lock file goes only when nobody holds it, and a holder of a removed file
// never shares the lock with one of the new file.
func TestLockFileRemoval(t *testing.T) {
	p := filepath.Join(t.TempDir(), "x.lock")
	f, ok, err := tryLockFile(p)
	if err != nil || !ok {
		t.Fatalf("first lock: %v %v", ok, err)
	}
	if removeLockFile(p) {
		t.Fatal("removed a held lock")
	}
	if _, err := os.Stat(p); err != nil {
		t.Fatalf("held lock file gone: %v", err)
	}
	if _, ok, _ := tryLockFile(p); ok {
		t.Fatal("two holders")
	}
	f.Close()
	if !removeLockFile(p) {
		t.Fatal("free lock not removed")
	}
	if _, err := os.Stat(p); !os.IsNotExist(err) {
		t.Fatalf("lock file left: %v", err)
	}
	// Opened before the removal, locked after it: tryLockFile sees the
	// file is no longer p's and locks the new one instead.
	old, err := os.OpenFile(p, os.O_CREATE|os.O_RDWR, 0o600)
	if err != nil {
		t.Fatal(err)
	}
	defer old.Close()
	if !removeLockFile(p) {
		t.Fatal("not removed")
	}
	g, ok, err := tryLockFile(p)
	if err != nil || !ok {
		t.Fatalf("lock after removal: %v %v", ok, err)
	}
	defer g.Close()
	var a, b unix.Stat_t
	unix.Fstat(int(g.Fd()), &a)
	unix.Fstat(int(old.Fd()), &b)
	if a.Ino == b.Ino {
		t.Fatal("locked the removed file")
	}
}
