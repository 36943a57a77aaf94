package procfs

import (
	"os"
	"os/exec"
	"strings"
	"testing"

	"github.com/containerd/errdefs"
)

// A live process has a start time that does not change; a reaped one is not
// found; a zombie says so.
func TestReadStat(t *testing.T) {
	self, err := ReadStat(os.Getpid())
	if err != nil || self.StartTime == 0 || self.Zombie() {
		t.Fatalf("self: %+v %v", self, err)
	}
	again, _ := ReadStat(os.Getpid())
	if again.StartTime != self.StartTime {
		t.Errorf("start time changed: %d then %d", self.StartTime, again.StartTime)
	}
	cmd := exec.Command("true")
	if err := cmd.Start(); err != nil {
		t.Skip(err)
	}
	pid := cmd.Process.Pid
	// Not yet reaped: a zombie once it has exited.
	for i := 0; i < 1000; i++ {
		if st, err := ReadStat(pid); err == nil && st.Zombie() {
			break
		}
	}
	if st, err := ReadStat(pid); err != nil || !st.Zombie() {
		t.Errorf("exited, unreaped child: %+v %v, want a zombie", st, err)
	}
	cmd.Wait()
	if _, err := ReadStat(pid); !errdefs.IsNotFound(err) {
		t.Errorf("reaped child: %v, want not found", err)
	}
}

// This process has a memory cgroup, v1 or unified, that /proc/self/cgroup
// names; an unknown controller falls back to the unified one or is not found.
func TestCgroup(t *testing.T) {
	path, _, err := Cgroup(os.Getpid(), "memory")
	if err != nil || !strings.HasPrefix(path, "/") {
		t.Fatalf("memory cgroup: %q %v", path, err)
	}
	if _, _, err := Cgroup(1<<30, "memory"); !errdefs.IsNotFound(err) {
		t.Errorf("no such process: %v, want not found", err)
	}
}

func TestMounts(t *testing.T) {
	ms, err := Mounts()
	if err != nil {
		t.Fatal(err)
	}
	found := false
	for _, m := range ms {
		found = found || m.Point == "/proc" && m.FSType == "proc"
	}
	if !found {
		t.Errorf("no proc mount at /proc in %d mounts", len(ms))
	}
	if got := unescapeMount(`/a\040b\134c`); got != `/a b\c` {
		t.Errorf("unescape: %q", got)
	}
}
