package memfile_test

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"strconv"
	"testing"

	"github.com/containerd/errdefs"
	"github.com/lazyfork/lazyfork/memfile"
	"golang.org/x/sys/unix"
)

// TestRefsRealCopies: a memory file stays while anything references it (a
// snapshot, a restored copy by pid, a container holder) or any process maps
// it, and is freed when the last of them goes.
func TestRefsRealCopies(t *testing.T) {
	e := newEnv(t)
	ctx := context.Background()
	dir := e.dump(e.start(8, 0))
	res := e.rewrite(dir)
	file := filepath.Join(e.famDir, res.Files[0])
	exists := func() bool { _, err := os.Stat(file); return err == nil }

	hs, err := e.store.Holders(e.family)
	if err != nil {
		t.Fatal(err)
	}
	if _, ok := hs[memfile.HolderSnapshot+dir]; !ok {
		t.Fatalf("the snapshot holds nothing: %v", hs)
	}
	copyPID := e.restore(dir)
	pidHolder := memfile.HolderPID + strconv.Itoa(copyPID)
	if err := e.store.Ref(e.family, pidHolder, res.Files); err != nil {
		t.Fatal(err)
	}
	if err := e.store.Ref(e.family, "container:test/c1", res.Files); err != nil {
		t.Fatal(err)
	}

	// The snapshot goes; the copy and the container still hold the file.
	if err := os.RemoveAll(dir); err != nil {
		t.Fatal(err)
	}
	if freed, err := e.store.GC(ctx); err != nil || len(freed) != 0 || !exists() {
		t.Fatalf("GC freed %v (err %v) while a copy and a container hold it", freed, err)
	}
	if err := e.store.Unref(e.family, "container:test/c1"); err != nil {
		t.Fatal(err)
	}
	if !exists() {
		t.Fatal("freed while a live copy holds it")
	}
	// Without any reference, the copy still maps it: still pinned.
	if err := e.store.Unref(e.family, pidHolder); err != nil {
		t.Fatal(err)
	}
	if !exists() {
		t.Fatal("freed while a copy maps it")
	}
	e.verifyTree(copyPID)
	// A dump of the copy cannot become a snapshot of another family (which
	// would not pin the files it maps).
	otherDir, err := e.store.FamilyDir("other")
	if err != nil {
		t.Fatal(err)
	}
	d := e.dump(copyPID)
	if _, err := e.store.Rewrite(ctx, d, memfile.RewriteOptions{Family: "other", MapDir: otherDir}); !errors.Is(err, errdefs.ErrFailedPrecondition) {
		t.Fatalf("rewrite into another family: %v", err)
	}
	kill(copyPID)
	freed, err := e.store.GC(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if exists() || len(freed) != 1 || freed[0] != res.Files[0] {
		t.Fatalf("after the last user went, GC freed %v", freed)
	}
}

// TestRefsDeadPID: a pid holder whose process is gone (or whose PID was
// recycled) holds nothing; a half-written file of a dead writer is removed,
// one being written is not. No root or CRIU needed.
func TestRefsDeadPID(t *testing.T) {
	s, err := memfile.OpenStore(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	dir, err := s.FamilyDir("f1")
	if err != nil {
		t.Fatal(err)
	}
	for _, n := range []string{"a.mem", "b.mem"} {
		if err := os.WriteFile(filepath.Join(dir, n), []byte("x"), 0o400); err != nil {
			t.Fatal(err)
		}
	}
	if err := s.Ref("f1", memfile.HolderPID+strconv.Itoa(os.Getpid()), []string{"a.mem"}); err != nil {
		t.Fatal(err)
	}
	if err := s.Ref("f1", memfile.HolderPID+"999999999", []string{"b.mem"}); err == nil {
		t.Fatal("ref by a process that does not exist succeeded")
	}
	if err := s.Ref("f1", "container:x", []string{"missing.mem"}); err == nil {
		t.Fatal("ref of a missing file succeeded")
	}
	if err := s.Ref("f1", "container:x", []string{"../a.mem"}); err == nil {
		t.Fatal("ref of a path outside the family succeeded")
	}
	if _, err := s.FamilyDir("../etc"); err == nil {
		t.Fatal("bad family name accepted")
	}
	abandoned := filepath.Join(dir, ".tmp-c.mem")
	os.WriteFile(abandoned, nil, 0o400)
	busy := filepath.Join(dir, ".tmp-d.mem")
	os.WriteFile(busy, nil, 0o400)
	bf, _ := os.Open(busy)
	defer bf.Close()
	unix.Flock(int(bf.Fd()), unix.LOCK_EX)

	freed, err := s.GC(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	if len(freed) != 1 || freed[0] != "b.mem" {
		t.Fatalf("freed %v, expected [b.mem]", freed)
	}
	if _, err := os.Stat(abandoned); err == nil {
		t.Error("abandoned half-written file kept")
	}
	if _, err := os.Stat(busy); err != nil {
		t.Error("file being written was removed")
	}
	// Reopening the store (a restart) sees the same references.
	s2, _ := memfile.OpenStore(s.Root())
	hs, err := s2.Holders("f1")
	if err != nil || len(hs) != 1 {
		t.Fatalf("holders after reopen: %v %v", hs, err)
	}
	if err := s2.Unref("f1", memfile.HolderPID+strconv.Itoa(os.Getpid())); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(filepath.Join(dir, "a.mem")); err == nil {
		t.Error("a.mem kept after its only holder went")
	}
}
