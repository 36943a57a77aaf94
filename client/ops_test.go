package client

import (
	"context"
	"errors"
	"io"
	"os"
	"path/filepath"
	"testing"

	"github.com/containerd/errdefs"
	"golang.org/x/sys/unix"
)

func TestCheckCount(t *testing.T) {
	if err := checkCount("p", 100000, DefaultMaxForks); !errdefs.IsInvalidArgument(err) {
		t.Errorf("n = 100000: %v", err)
	}
	if err := checkCount("p", DefaultMaxForks, DefaultMaxForks); err != nil {
		t.Errorf("n = limit: %v", err)
	}
	if err := checkMemory("p", 1<<40); !errdefs.IsResourceExhausted(err) {
		t.Errorf("2^40 forks: %v", err)
	}
}

// An operation record names a live owner until its process is gone.
func TestOpRecord(t *testing.T) {
	c := New(nil, WithRoot(t.TempDir()))
	o, err := c.newOp("ns", "parent")
	if err != nil {
		t.Fatal(err)
	}
	rec, err := readOp(c.opPath(o.rec.ID))
	if err != nil || !rec.alive() || rec.Parent != "parent" {
		t.Fatalf("record %+v, %v", rec, err)
	}
	rec.PIDStart = "1" // another process that had this pid
	if rec.alive() {
		t.Error("a reused pid counts as the owner")
	}
	if err := o.done(); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(c.opPath(o.rec.ID)); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("record left: %v", err)
	}
}

func TestFailpoint(t *testing.T) {
	failpointOut = io.Discard
	t.Setenv("LAZYFORK_FAILPOINT", FailAfterPause+":sleep=1h")
	if err := failpoint(context.Background(), FailAfterCheckpt); err != nil {
		t.Errorf("another stage: %v", err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	if err := failpoint(ctx, FailAfterPause); !errors.Is(err, context.Canceled) {
		t.Errorf("a cancelled sleep: %v", err)
	}
}

func TestLockParent(t *testing.T) {
	c := New(nil, WithRoot(t.TempDir()))
	unlock, err := c.lockParent(context.Background(), "ns", "p")
	if err != nil {
		t.Fatal(err)
	}
	if _, ok, _ := c.tryLockParent("ns", "p"); ok {
		t.Error("a second lock of one parent was granted")
	}
	if u, ok, _ := c.tryLockParent("ns", "q"); !ok {
		t.Error("another parent's lock was refused")
	} else {
		u()
	}
	unlock()
	if u, ok, _ := c.tryLockParent("ns", "p"); !ok {
		t.Error("lock not released")
	} else {
		u()
	}
}

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
