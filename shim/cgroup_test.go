package shim

import (
	"os"
	"testing"

	"github.com/containerd/cgroups/v3"
	"github.com/containerd/cgroups/v3/cgroup1"
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
