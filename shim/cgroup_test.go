package shim

import (
	"bytes"
	"context"
	"os"
	"testing"

	"github.com/containerd/cgroups/v3"
	"github.com/containerd/cgroups/v3/cgroup1"

	"github.com/lazyfork/lazyfork/internal/testutil"
)

// The shim's cgroup v1 paths, with the mount roots read once, are the ones
// cgroup1.PidPath finds by parsing mountinfo on every call.
func TestCgroupV1PathsAsCgroup1(t *testing.T) {
	if cgroups.Mode() == cgroups.Unified {
		t.Skip("cgroup v2 only host: the shim loads cgroups with cgroup2 here")
	}
	m, err := cgroupV1Mounts()
	if err != nil {
		t.Fatal(err)
	}
	pid := os.Getpid()
	ours, theirs := m.pidPath(pid), cgroup1.PidPath(pid)
	subs, err := cgroup1.Default()
	if err != nil {
		t.Fatal(err)
	}
	if len(subs) == 0 {
		t.Fatal("no cgroup v1 controllers mounted")
	}
	for _, s := range subs {
		a, aerr := ours(s.Name())
		b, berr := theirs(s.Name())
		if a != b || (aerr == nil) != (berr == nil) {
			t.Errorf("%s: ours %q %v, cgroup1's %q %v", s.Name(), a, aerr, b, berr)
		}
	}
	if _, err := loadCgroup(pid); err != nil {
		t.Errorf("load this process's cgroup: %v", err)
	}
}

// warmCgroupAttach's write moves nothing: the process stays in every cgroup
// it was in, and the write goes through (a cgroup.procs file that exists).
// LAZYFORK_CGROUP_WARM=off starts none.
func TestWarmCgroupAttachMovesNothing(t *testing.T) {
	testutil.RequiresRoot(t)
	t.Setenv(cgroupWarmEnv, "off")
	warmCgroupAttach(context.Background())
	if warming.Load() {
		t.Fatalf("%s=off started a write", cgroupWarmEnv)
	}
	before, err := os.ReadFile("/proc/self/cgroup")
	if err != nil {
		t.Fatal(err)
	}
	if err := rewriteOwnCgroup(); err != nil {
		t.Fatal(err)
	}
	after, err := os.ReadFile("/proc/self/cgroup")
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(before, after) {
		t.Errorf("cgroups before:\n%s\nafter:\n%s", before, after)
	}
}
