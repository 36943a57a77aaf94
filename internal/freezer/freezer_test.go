package freezer

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"testing"
	"time"

	"github.com/lazyfork/lazyfork/internal/testutil"
)

// cgroupWith makes a cgroup of this host's freezer (the v1 controller's
// hierarchy, or the unified one) holding pid, removed at the end.
func cgroupWith(t *testing.T, pid int) string {
	t.Helper()
	root := "/sys/fs/cgroup/freezer"
	if _, err := os.Stat(filepath.Join(root, "freezer.state")); err != nil {
		if _, err := os.Stat(filepath.Join(root, "tasks")); err != nil {
			root = "/sys/fs/cgroup" // v2
		}
	}
	cg := filepath.Join(root, fmt.Sprintf("lazyfork-freezer-test-%d", os.Getpid()))
	if err := os.Mkdir(cg, 0o755); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		Set(cg, false)
		os.WriteFile(filepath.Join(root, "cgroup.procs"), []byte(strconv.Itoa(pid)), 0)
		for range 100 {
			if os.Remove(cg) == nil {
				return
			}
			time.Sleep(20 * time.Millisecond)
		}
		t.Errorf("cgroup %s stays", cg)
	})
	if err := os.WriteFile(filepath.Join(cg, "cgroup.procs"), []byte(strconv.Itoa(pid)), 0); err != nil {
		t.Fatal(err)
	}
	return cg
}

// A frozen cgroup's process makes no progress, and goes on once thawed;
// State says which.
func TestSetFreezesAndThaws(t *testing.T) {
	testutil.RequiresRoot(t)
	out := filepath.Join(t.TempDir(), "ticks")
	cmd := exec.Command("sh", "-c", `while :; do echo x >> "$0"; sleep 0.005; done`, out)
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cmd.Process.Kill(); cmd.Wait() })
	cg := cgroupWith(t, cmd.Process.Pid)
	size := func() int64 {
		fi, err := os.Stat(out)
		if err != nil {
			return 0
		}
		return fi.Size()
	}
	if err := Set(cg, true); err != nil {
		t.Fatal(err)
	}
	if frozen, err := State(cg); err != nil || !frozen {
		t.Fatalf("State after freezing: %v, %v", frozen, err)
	}
	before := size()
	time.Sleep(200 * time.Millisecond)
	if after := size(); after != before {
		t.Fatalf("the frozen process wrote on: %d -> %d bytes", before, after)
	}
	if err := Set(cg, false); err != nil {
		t.Fatal(err)
	}
	if frozen, err := State(cg); err != nil || frozen {
		t.Fatalf("State after thawing: %v, %v", frozen, err)
	}
	deadline := time.Now().Add(5 * time.Second)
	for size() == before {
		if time.Now().After(deadline) {
			t.Fatal("the thawed process does not run")
		}
		time.Sleep(10 * time.Millisecond)
	}
}

func TestSetRefusesANonCgroup(t *testing.T) {
	if err := Set(t.TempDir(), true); err == nil {
		t.Fatal("froze a plain directory")
	}
}
