package cgroupmem

import (
	"os"
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
