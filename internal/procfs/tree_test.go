package procfs

import (
	"os"
	"os/exec"
	"slices"
	"strconv"
	"testing"

	"github.com/containerd/errdefs"
)

// A child started by this test is in this process's tree, names its parent,
// is found by its argv, and has memory; a reaped one is not found.
func TestTreeFindMem(t *testing.T) {
	cmd := exec.Command("sleep", "1000.4242")
	if err := cmd.Start(); err != nil {
		t.Skip(err)
	}
	pid := cmd.Process.Pid
	tree, err := Tree(os.Getpid())
	if err != nil || tree[0] != os.Getpid() || !slices.Contains(tree, pid) {
		t.Errorf("Tree(self) = %v, %v; want self first and child %d", tree, err, pid)
	}
	if st, err := ReadStat(pid); err != nil || st.PPID != os.Getpid() {
		t.Errorf("stat of child: %+v %v", st, err)
	}
	found := Find(func(args []string) bool { return HasArg(args, "1000.4242", "sleep") })
	if len(found) != 1 || found[0].PID != pid || found[0].Args[0] != "sleep" {
		t.Errorf("Find = %+v, want child %d", found, pid)
	}
	if ns, err := NSPID(pid); err != nil || ns <= 0 {
		t.Errorf("NSPID = %d, %v", ns, err)
	}
	m, err := ReadMem(os.Getpid())
	if err != nil || m.RSS <= 0 || m.RssAnon <= 0 || m.Pss <= 0 {
		t.Errorf("ReadMem(self) = %+v, %v", m, err)
	}
	if tm, err := TreeMem(os.Getpid()); err != nil || tm.RSS < m.RSS {
		t.Errorf("TreeMem(self) = %+v, %v", tm, err)
	}
	cmd.Process.Kill()
	cmd.Wait()
	if Alive(pid) {
		t.Errorf("reaped child %d still alive", pid)
	}
	if _, err := Tree(pid); !errdefs.IsNotFound(err) {
		t.Errorf("Tree of reaped child: %v", err)
	}
	if v, err := Status(os.Getpid(), "Pid"); err != nil || v != strconv.Itoa(os.Getpid()) {
		t.Errorf("Status Pid = %q, %v", v, err)
	}
}

// MemTotal is there and larger than MemAvailable; a made-up field is not.
func TestMemInfo(t *testing.T) {
	total, err := MemInfo("MemTotal")
	avail, err2 := MemInfo("MemAvailable")
	if err != nil || err2 != nil || total <= 0 || avail <= 0 || avail > total {
		t.Errorf("MemTotal %d (%v), MemAvailable %d (%v)", total, err, avail, err2)
	}
	if _, err := MemInfo("NoSuchField"); !errdefs.IsNotFound(err) {
		t.Errorf("missing field: %v", err)
	}
}
