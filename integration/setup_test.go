package integration

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/lazyfork/lazyfork/integration/harness"
	"github.com/lazyfork/lazyfork/internal/testutil"
)

// setupStack is a private LazyFork stack made by `lazyfork setup`, as `make
// demo` and a user make one.
type setupStack struct {
	t              testing.TB
	bin, ctr, dir  string
	root, addr, ns string
	config         string
}

// containers lists the stack's containers (by ctr, which needs nothing of
// LazyFork).
func (s *setupStack) containers() []string {
	out, err := exec.Command(s.ctr, "--address", s.addr, "-n", s.ns, "containers", "ls", "-q").Output()
	if err != nil {
		return nil
	}
	return strings.Fields(string(out))
}

func (s *setupStack) setupArgs() []string {
	return []string{"setup", "--config", s.config, "--state", filepath.Join(s.dir, "state"), "--logs", filepath.Join(s.dir, "log")}
}

// lf runs the lazyfork CLI against the stack.
func (s *setupStack) lf(args ...string) (string, error) {
	full := append([]string{"--address", s.addr, "--namespace", s.ns, "--root", s.root, "--log-dir", filepath.Join(s.dir, "log", "containers")}, args...)
	out, err := exec.Command(filepath.Join(s.bin, "lazyfork"), full...).CombinedOutput()
	return string(out), err
}

func (s *setupStack) mustLF(args ...string) string {
	s.t.Helper()
	out, err := s.lf(args...)
	if err != nil {
		logs, _ := exec.Command("tail", "-n", "30", filepath.Join(s.dir, "log", "containerd.log")).CombinedOutput()
		s.t.Fatalf("lazyfork %s: %v\n%s\n--- containerd.log (tail):\n%s", strings.Join(args, " "), err, out, logs)
	}
	return out
}

// newSetupStack runs setup on fresh directories and imports the busybox image;
// cleanup deletes the stack's containers and runs setup --down --purge.
func newSetupStack(t *testing.T, ns string) *setupStack {
	t.Helper()
	testutil.RequiresCRIU(t)
	testutil.RequiresBinary(t, "containerd")
	ctr := testutil.RequiresBinary(t, "ctr")
	dir, err := os.MkdirTemp("/tmp", "lfsetup-")
	if err != nil {
		t.Fatal(err)
	}
	s := &setupStack{t: t, bin: lfBin(t), ctr: ctr, dir: dir, root: filepath.Join(dir, "root"), addr: filepath.Join(dir, "c.sock"), ns: ns, config: filepath.Join(dir, "config.toml")}
	t.Cleanup(func() {
		for _, id := range s.containers() {
			s.lf("delete", "-f", id)
		}
		if out, err := s.lf(append(s.setupArgs(), "--down", "--purge")...); err != nil {
			t.Errorf("setup --down --purge: %v\n%s", err, out)
		}
		if mounts, _ := harness.MountsUnder(dir); len(mounts) > 0 {
			for i := len(mounts) - 1; i >= 0; i-- {
				_ = unix.Unmount(mounts[i], unix.MNT_DETACH)
			}
		}
		os.RemoveAll(dir)
	})
	out := s.mustLF(s.setupArgs()...)
	t.Logf("setup:\n%s", out)
	img, err := harness.EnsureImage(context.Background(), "busybox")
	if err != nil {
		t.Fatal(err)
	}
	if out, err := exec.Command(ctr, "--address", s.addr, "-n", ns, "images", "import", "--no-unpack", img).CombinedOutput(); err != nil {
		t.Fatalf("import busybox: %v\n%s", err, out)
	}
	return s
}

// cgroupOf is a process's memory cgroup (v1) or its unified cgroup (v2).
func cgroupOf(pid int) string {
	b, _ := os.ReadFile(fmt.Sprintf("/proc/%d/cgroup", pid))
	unified := ""
	for _, l := range strings.Split(string(b), "\n") {
		f := strings.SplitN(l, ":", 3)
		if len(f) != 3 {
			continue
		}
		if strings.Contains(","+f[1]+",", ",memory,") {
			return f[2]
		}
		if f[0] == "0" {
			unified = f[2]
		}
	}
	return unified
}

func pidFrom(path string) int {
	b, _ := os.ReadFile(path)
	pid, _ := strconv.Atoi(strings.TrimSpace(string(b)))
	return pid
}

// waitFor polls cond every 100 ms until it holds or the (generous) deadline.
func waitFor(t testing.TB, what string, limit time.Duration, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(limit)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("%s: not within %s", what, limit)
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// TestSetupServices: without systemd, setup runs the snapshotter and
// containerd in cgroups of their own (not the caller's), restarts a snapshotter
// that dies, is idempotent, and `--down --purge` leaves nothing: no config, no
// state, logs, mounts or cgroups; it refuses to purge while a container's shim
// still holds the memory files.
func TestSetupServices(t *testing.T) {
	s := newSetupStack(t, "lfsvc")
	mine := cgroupOf(os.Getpid())
	var stack string
	for _, name := range []string{"snapshotter", "containerd"} {
		pid := pidFrom(filepath.Join(s.root, name+".child.pid"))
		if pid <= 1 {
			t.Fatalf("no %s.child.pid in %s", name, s.root)
		}
		cg := cgroupOf(pid)
		if cg == mine || !strings.HasSuffix(cg, "/"+name) || !strings.HasPrefix(cg, "/lazyfork/") {
			t.Errorf("%s (pid %d) runs in cgroup %q (the caller's: %q), want /lazyfork/<stack>/%s", name, pid, cg, mine, name)
		}
		stack = filepath.Dir(cg)
	}

	// A snapshotter that dies comes back, and the stack uses it.
	old := pidFrom(filepath.Join(s.root, "snapshotter.child.pid"))
	if err := unix.Kill(old, unix.SIGKILL); err != nil {
		t.Fatal(err)
	}
	waitFor(t, "a new snapshotter", 60*time.Second, func() bool {
		p := pidFrom(filepath.Join(s.root, "snapshotter.child.pid"))
		return p > 1 && p != old && unix.Kill(p, 0) == nil
	})
	waitFor(t, "the snapshotter answering", 60*time.Second, func() bool {
		out, err := s.lf("status", "--format", "json")
		return err == nil && strings.Contains(out, `"snapshotter": "lazyfork (proxy plugin)"`)
	})

	cfg, _ := os.ReadFile(s.config)
	dropIn, _ := os.ReadFile(filepath.Join(s.dir, "conf.d", "lazyfork.toml"))
	again := s.mustLF(s.setupArgs()...)
	if !strings.Contains(again, "already has") || !strings.Contains(again, "snapshotter: running") {
		t.Errorf("second setup:\n%s", again)
	}
	cfg2, _ := os.ReadFile(s.config)
	dropIn2, _ := os.ReadFile(filepath.Join(s.dir, "conf.d", "lazyfork.toml"))
	if string(cfg) != string(cfg2) || string(dropIn) != string(dropIn2) {
		t.Errorf("second setup changed the configuration")
	}

	// A container's shim holds the memory files: --purge refuses.
	s.mustLF("create", "--name", "c1", harness.BusyboxImage, "--", "sleep", "3600")
	out, err := s.lf(append(s.setupArgs(), "--down", "--purge")...)
	if err == nil || !strings.Contains(out, "shims") {
		t.Fatalf("--down --purge with a container running: %v\n%s", err, out)
	}
	if _, err := os.Stat(filepath.Join(s.dir, "state")); err != nil {
		t.Errorf("a refused purge removed the state: %v", err)
	}
	s.mustLF(s.setupArgs()...)
	s.mustLF("delete", "-f", "c1")

	out = s.mustLF(append(s.setupArgs(), "--down", "--purge")...)
	t.Logf("down --purge:\n%s", out)
	left, _ := os.ReadDir(s.dir)
	var names []string
	for _, e := range left {
		names = append(names, e.Name())
	}
	if len(names) > 0 {
		t.Errorf("left in %s after --down --purge: %v", s.dir, names)
	}
	if mounts, _ := harness.MountsUnder(s.dir); len(mounts) > 0 {
		t.Errorf("mounts left: %v", mounts)
	}
	// In every hierarchy: runc makes the containers' groups (and their
	// parents) in cpuset and a hybrid setup's unified one too.
	if left := harness.CgroupDirs(stack); len(left) > 0 {
		t.Errorf("cgroups left: %v", left)
	}
}

// TestSystemdUnits: `make install` puts the snapshotter's unit and
// containerd's drop-in in place (PREFIX substituted), and systemd-analyze
// verify takes both without a complaint (with a stand-in containerd.service,
// as containerd's own unit is not on every test machine). This machine need not
// run systemd: enabling them is `lazyfork setup`'s job where it does.
func TestSystemdUnits(t *testing.T) {
	analyze := testutil.RequiresBinary(t, "systemd-analyze")
	repo, err := harness.RepoRoot()
	if err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	units := filepath.Join(dir, "systemd")
	cmd := exec.Command("make", "install", "PREFIX="+dir, "SYSTEMDDIR="+units)
	cmd.Dir = repo
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("make install: %v\n%s", err, out)
	}
	for _, f := range []string{"lazyfork-snapshotter.service", "containerd.service.d/lazyfork.conf"} {
		b, err := os.ReadFile(filepath.Join(units, f))
		if err != nil {
			t.Fatal(err)
		}
		if strings.Contains(string(b), "@PREFIX@") || !strings.Contains(string(b), dir+"/") {
			t.Errorf("%s: PREFIX not substituted:\n%s", f, b)
		}
	}
	stub := "[Unit]\nDescription=containerd (stand-in)\n[Service]\nExecStart=/bin/true\n[Install]\nWantedBy=multi-user.target\n"
	if err := os.WriteFile(filepath.Join(units, "containerd.service"), []byte(stub), 0o644); err != nil {
		t.Fatal(err)
	}
	v := exec.Command(analyze, "verify", "--man=no", "./lazyfork-snapshotter.service", "./containerd.service")
	v.Dir = units
	out, err := v.CombinedOutput()
	if err != nil || len(strings.TrimSpace(string(out))) > 0 {
		t.Errorf("systemd-analyze verify: %v\n%s", err, out)
	}
	un := exec.Command("make", "uninstall", "PREFIX="+dir, "SYSTEMDDIR="+units)
	un.Dir = repo
	if out, err := un.CombinedOutput(); err != nil {
		t.Fatalf("make uninstall: %v\n%s", err, out)
	}
	for _, f := range []string{"bin/lazyfork", "bin/lazyfork-snapshotter", "systemd/lazyfork-snapshotter.service", "systemd/containerd.service.d"} {
		if _, err := os.Stat(filepath.Join(dir, f)); err == nil {
			t.Errorf("%s left after make uninstall", f)
		}
	}
}

// taskPid is the pid of a running task of the stack, 0 if none runs.
func (s *setupStack) taskPid(id string) int {
	out, err := exec.Command(s.ctr, "--address", s.addr, "-n", s.ns, "tasks", "ls").Output()
	if err != nil {
		return 0
	}
	for _, l := range strings.Split(string(out), "\n") {
		f := strings.Fields(l)
		if len(f) == 3 && f[0] == id && f[2] == "RUNNING" {
			pid, _ := strconv.Atoi(f[1])
			return pid
		}
	}
	return 0
}

// TestPrivateStacksSideBySide: two stacks made by `lazyfork setup --state`
// (as make demo and the tests make them), the same namespace and container
// name in both. Before, they shared runc's root (the second create failed:
// "container with given ID already exists"), the shim socket directory and the
// container's cgroup, and deleting one stopped the other's container.
func TestPrivateStacksSideBySide(t *testing.T) {
	a := newSetupStack(t, "lfpriv")
	b := newSetupStack(t, "lfpriv")
	for _, s := range []*setupStack{a, b} {
		s.mustLF("create", "--name", "same", harness.BusyboxImage, "--", "sh", "-c", "trap 'exit 0' TERM; while :; do sleep 0.2; done")
	}
	pa, pb := a.taskPid("same"), b.taskPid("same")
	if pa == 0 || pb == 0 {
		t.Fatalf("tasks: %d in A, %d in B", pa, pb)
	}
	if ca, cb := cgroupOf(pa), cgroupOf(pb); ca == cb {
		t.Errorf("both containers run in cgroup %s", ca)
	}
	for _, s := range []*setupStack{a, b} {
		if _, err := os.Stat(filepath.Join(s.dir, "state", "runc", s.ns, "same", "state.json")); err != nil {
			t.Errorf("runc state of %s not under its stack's state: %v", s.dir, err)
		}
	}
	if _, err := os.Stat(filepath.Join("/run/containerd/runc", "lfpriv", "same")); err == nil {
		t.Errorf("runc state in the node's /run/containerd/runc/lfpriv")
	}

	// Deleting A's container, then taking A down, leaves B's running.
	a.mustLF("delete", "-f", "same")
	a.mustLF(append(a.setupArgs(), "--down")...)
	if p := b.taskPid("same"); p != pb || unix.Kill(pb, 0) != nil {
		t.Fatalf("B's container (pid %d) is gone after A's was deleted and A taken down (now: %d)", pb, p)
	}
	out := b.mustLF("exec", "same", "--", "echo", "alive")
	if !strings.Contains(out, "alive") {
		t.Errorf("exec in B's container: %q", out)
	}
}
