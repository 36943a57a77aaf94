package cgroupmem

import (
	"fmt"
	"os"
	"path/filepath"
	"testing"

	"github.com/containerd/errdefs"

	"github.com/lazyfork/lazyfork/internal/procfs"
)

// This process's own memory cgroup has a usage and a memory.stat; a cgroup
// that does not exist is not found; a relative path is refused.
func TestOwnCgroup(t *testing.T) {
	p, _, err := procfs.Cgroup(os.Getpid(), "memory")
	if err != nil {
		t.Skip(err)
	}
	u, err := Usage(p)
	if err != nil {
		t.Skipf("no memory accounting here: %v", err)
	}
	if u <= 0 {
		t.Errorf("usage of %s = %d", p, u)
	}
	st, err := Stat(p)
	if err != nil || len(st) == 0 {
		t.Errorf("memory.stat of %s: %v %v", p, st, err)
	}
	if _, err := Usage("/no/such/lazyfork/cgroup"); !errdefs.IsNotFound(err) {
		t.Errorf("missing cgroup: %v", err)
	}
	if _, err := Usage("system.slice:foo"); !errdefs.IsInvalidArgument(err) {
		t.Errorf("relative path: %v", err)
	}
}

// A cgroup made with a limit reports it and its usage; without one, ok is false.
func TestLimit(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root to make a cgroup")
	}
	self, _, err := procfs.Cgroup(os.Getpid(), "memory")
	if err != nil {
		t.Skip(err)
	}
	ds, err := dirs(self, false)
	if err != nil || len(ds) == 0 {
		t.Skipf("no memory cgroup: %v", err)
	}
	p := filepath.Join(self, fmt.Sprintf("lazyfork-limit-test-%d", os.Getpid()))
	dir := filepath.Join(ds[0][0], filepath.Base(p))
	if err := os.Mkdir(dir, 0o755); err != nil {
		t.Skipf("cannot make a cgroup under %s: %v", ds[0][0], err)
	}
	defer os.Remove(dir)
	if _, _, ok, err := Limit(p); err != nil || ok {
		t.Fatalf("new cgroup: ok %v err %v, want no limit", ok, err)
	}
	limitFile := "memory.max"
	if ds[0][1] == "memory.usage_in_bytes" {
		limitFile = "memory.limit_in_bytes"
	}
	if err := os.WriteFile(filepath.Join(dir, limitFile), []byte("67108864"), 0); err != nil {
		t.Fatal(err)
	}
	l, u, ok, err := Limit(p)
	if err != nil || !ok || l != 64<<20 || u < 0 {
		t.Fatalf("limited cgroup: limit %d usage %d ok %v err %v, want 64 MiB", l, u, ok, err)
	}
}

// The mount table is cached; a cgroup the cached hierarchies do not hold
// (one mounted since the table was read) is looked up in a fresh table.
func TestStaleMountTable(t *testing.T) {
	self, _, err := procfs.Cgroup(os.Getpid(), "memory")
	if err != nil {
		t.Skip(err)
	}
	if _, err := Usage(self); err != nil {
		t.Skipf("no memory usage for this process's cgroup: %v", err)
	}
	hierarchies.Lock()
	hierarchies.v1, hierarchies.v2 = []string{t.TempDir()}, nil
	hierarchies.Unlock()
	if u, err := Usage(self); err != nil || u <= 0 {
		t.Fatalf("usage of %s with a stale mount table: %d, %v", self, u, err)
	}
	if _, err := Stat(self); err != nil {
		t.Fatalf("memory.stat of %s: %v", self, err)
	}
}

// On a v1 memory hierarchy a cgroup's kernel memory is read; on v2 there is
// no such file (memory.stat counts it).
func TestKmemV1(t *testing.T) {
	self, v1, err := procfs.Cgroup(os.Getpid(), "memory")
	if err != nil {
		t.Skip(err)
	}
	k, ok := KmemV1(self)
	if v1 && (!ok || k < 0) {
		if _, err := os.Stat("/sys/fs/cgroup/memory/memory.kmem.usage_in_bytes"); err == nil {
			t.Errorf("kernel memory of %s on v1: %d %v", self, k, ok)
		}
	}
	if !v1 && ok {
		t.Errorf("kernel memory of %s on v2: %d, want none", self, k)
	}
}
