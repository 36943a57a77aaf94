package fidelity_test

// A cgroup per test run. The tests restore copies with criu --restore-detached;
// each copy is re-parented to the test binary (a child subreaper) and killed by its
// test's cleanup. A run killed from outside (SIGKILL, a stopped CI job, a timeout
// panic) runs no cleanup, and its copies, re-parented to init, run on forever. So
// the run joins a cgroup v2 of its own, lazyfork-test-fidelity/run-PID-STARTTIME,
// which every process it starts inherits: criurun restores with
// --manage-cgroups=ignore, so a copy stays in its restorer's cgroup (with any
// other mode CRIU would move it to the cgroup it was dumped in). A normal exit
// kills what is left in it and removes it; a killed run leaves it behind, and the
// next run kills and removes it (cgroup.kill, Linux 5.14). The start time in the
// name tells a live run from a dead one whose PID was reused. The cgroup sits
// outside the one the run came from: a job runner that kills its job's cgroup
// misses it, the next run does not. Runs must share a PID namespace (they do
// on a CI host): a live run whose PID another namespace hides looks dead.

import (
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/containerd/errdefs"
	"golang.org/x/sys/unix"

	"github.com/lazyfork/lazyfork/internal/procfs"
	"github.com/lazyfork/lazyfork/internal/testutil"
)

// runGroupParent is the directory, at the top of the cgroup2 hierarchy, that
// holds one cgroup per run.
const runGroupParent = "lazyfork-test-fidelity"

type runGroup struct {
	root string // where cgroup2 is mounted
	dir  string // this run's cgroup
	from string // the cgroup the run came from and goes back to before the kill
}

// enterRunGroup moves the test binary into a cgroup of its own, after killing
// the cgroups of runs that died. It does nothing unless the tests run for real
// (root, and LAZYFORK_INTEGRATION=1 or CI=true). Without cgroup2 or the right to
// use it, it says so and the tests run anyway, except under CI=true, where it
// exits.
func enterRunGroup() *runGroup {
	if os.Geteuid() != 0 || !testutil.IntegrationEnabled() {
		return nil
	}
	g, err := newRunGroup()
	if err != nil {
		if testutil.InCI() {
			fmt.Fprintf(os.Stderr, "fidelity: CI=true but %v\n", err)
			os.Exit(1)
		}
		fmt.Fprintf(os.Stderr, "fidelity: %v\nfidelity: the tests run without a cgroup of their own: if this run is killed, its detached copies outlive it\n", err)
	}
	return g
}

// leave takes the test binary out of the run's cgroup, kills what is still in
// it and removes it. It returns the exit code: code, or 1 if the clean-up failed
// under CI=true (its processes would outlive the run).
func (g *runGroup) leave(code int) int {
	if g == nil {
		return code
	}
	if err := g.close(); err != nil {
		fmt.Fprintf(os.Stderr, "fidelity: %v\n", err)
		if code == 0 && testutil.InCI() {
			return 1
		}
	}
	return code
}

func (g *runGroup) close() error {
	// Out first: cgroup.kill would kill this process too.
	pid := strconv.Itoa(os.Getpid())
	if err := writeCgroupFile(filepath.Join(g.from, "cgroup.procs"), pid); err != nil {
		if err2 := writeCgroupFile(filepath.Join(g.root, "cgroup.procs"), pid); err2 != nil {
			return fmt.Errorf("cannot leave the run's cgroup %s (back to %s: %v; to %s: %v), so what is left in it runs on: `echo 1 > %s/cgroup.kill`, then rmdir it",
				g.dir, g.from, err, g.root, err2, g.dir)
		}
	}
	if _, err := killGroup(g.dir); err != nil {
		return err
	}
	// Other runs may use the parent: only an empty one goes.
	_ = unix.Rmdir(filepath.Dir(g.dir))
	return nil
}

func newRunGroup() (*runGroup, error) {
	root, err := cgroup2Root()
	if err != nil {
		return nil, err
	}
	from, err := ownCgroup()
	if err != nil {
		return nil, err
	}
	g := &runGroup{root: root, from: filepath.Join(root, from)}
	if st, err := os.Stat(g.from); err != nil || !st.IsDir() {
		// The mount shows another part of the hierarchy than this process's
		// namespace: leave to its top.
		g.from = root
	}
	parent := filepath.Join(root, runGroupParent)
	if err := killStaleRuns(parent); err != nil {
		return nil, err
	}
	self, err := procfs.ReadStat(os.Getpid())
	if err != nil {
		return nil, err
	}
	g.dir = filepath.Join(parent, runName(os.Getpid(), self.StartTime))
	// A run that ends removes the parent when it is empty: make it again then.
	for try := 0; ; try++ {
		if err = os.MkdirAll(parent, 0o755); err == nil {
			err = unix.Mkdir(g.dir, 0o755)
		}
		if !errors.Is(err, unix.ENOENT) || try == 3 {
			break
		}
	}
	if err != nil {
		return nil, cgroupError("creating the run's cgroup "+g.dir, root, err)
	}
	undo := func() { _ = unix.Rmdir(g.dir); _ = unix.Rmdir(parent) }
	if _, err := os.Stat(filepath.Join(g.dir, "cgroup.kill")); err != nil {
		undo()
		return nil, fmt.Errorf("%s has no cgroup.kill (Linux 5.14 or later needed): a run's cgroup could not be killed", g.dir)
	}
	if err := writeCgroupFile(filepath.Join(g.dir, "cgroup.procs"), strconv.Itoa(os.Getpid())); err != nil {
		undo()
		return nil, cgroupError("moving the test process into "+g.dir, root, err)
	}
	return g, nil
}

// killStaleRuns kills and removes every run cgroup under parent whose run is
// gone. Names it does not know are left alone.
func killStaleRuns(parent string) error {
	ents, err := os.ReadDir(parent)
	if errors.Is(err, fs.ErrNotExist) {
		return nil
	}
	if err != nil {
		return cgroupError("reading "+parent, filepath.Dir(parent), err)
	}
	for _, e := range ents {
		pid, start, ok := parseRunName(e.Name())
		if !e.IsDir() || !ok || !staleRun(pid, start, procfs.ReadStat) {
			continue
		}
		dir := filepath.Join(parent, e.Name())
		n, err := killGroup(dir)
		if err != nil {
			return fmt.Errorf("the cgroup of run %d, which ended without cleaning up: %w", pid, err)
		}
		fmt.Fprintf(os.Stderr, "fidelity: run %d ended without cleaning up: killed the %d processes left in %s and removed it\n", pid, n, dir)
	}
	return nil
}

// runName names the cgroup of the run whose test binary is pid, started at
// start (clock ticks after boot, /proc/PID/stat field 22).
func runName(pid int, start uint64) string {
	return fmt.Sprintf("run-%d-%d", pid, start)
}

// parseRunName reads a name runName made.
func parseRunName(name string) (pid int, start uint64, ok bool) {
	rest, ok := strings.CutPrefix(name, "run-")
	p, s, found := strings.Cut(rest, "-")
	if !ok || !found || !digits(p) || !digits(s) {
		return 0, 0, false
	}
	pid, err := strconv.Atoi(p)
	if err != nil || pid <= 0 {
		return 0, 0, false
	}
	start, err = strconv.ParseUint(s, 10, 64)
	if err != nil {
		return 0, 0, false
	}
	return pid, start, true
}

func digits(s string) bool {
	return s != "" && strings.Trim(s, "0123456789") == ""
}

// staleRun reports whether the run that made a cgroup is gone: its PID names
// no process, a zombie, or a process started at another time (a reused PID).
// An error other than not found keeps the cgroup: better a leftover than a
// live run killed.
func staleRun(pid int, start uint64, stat func(int) (procfs.Stat, error)) bool {
	st, err := stat(pid)
	if err != nil {
		return errdefs.IsNotFound(err)
	}
	return st.Zombie() || st.StartTime != start
}

// killGroup kills every process in the cgroup dir and below, waits for them to
// be gone and removes the cgroups. It returns how many processes dir held.
func killGroup(dir string) (int, error) {
	n := len(groupProcs(dir))
	if err := writeCgroupFile(filepath.Join(dir, "cgroup.kill"), "1"); err != nil {
		if errors.Is(err, fs.ErrNotExist) {
			if _, serr := os.Stat(dir); errors.Is(serr, fs.ErrNotExist) {
				return 0, nil // another run removed it
			}
			return 0, fmt.Errorf("%s has no cgroup.kill (Linux 5.14 or later needed): kill its processes (cgroup.procs) by hand and rmdir it", dir)
		}
		return 0, cgroupError("killing the cgroup "+dir, filepath.Dir(dir), err)
	}
	deadline := time.Now().Add(10 * time.Second)
	for {
		err := removeGroup(dir)
		if err == nil {
			return n, nil
		}
		if !errors.Is(err, unix.EBUSY) || time.Now().After(deadline) {
			return n, fmt.Errorf("removing %s after its cgroup.kill (processes still in it: %v): %w", dir, groupProcs(dir), err)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// removeGroup removes the cgroup dir and the cgroups below it; a populated
// one fails with EBUSY.
func removeGroup(dir string) error {
	ents, _ := os.ReadDir(dir)
	for _, e := range ents {
		if e.IsDir() {
			if err := removeGroup(filepath.Join(dir, e.Name())); err != nil {
				return err
			}
		}
	}
	if err := unix.Rmdir(dir); err != nil && !errors.Is(err, unix.ENOENT) {
		return err
	}
	return nil
}

// groupProcs lists the processes in cgroup dir (not below it).
func groupProcs(dir string) []string {
	b, _ := os.ReadFile(filepath.Join(dir, "cgroup.procs"))
	return strings.Fields(string(b))
}

// writeCgroupFile writes s to an existing cgroup file (never creates one).
func writeCgroupFile(path, s string) error {
	f, err := os.OpenFile(path, os.O_WRONLY, 0)
	if err != nil {
		return err
	}
	_, err = f.WriteString(s)
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	return err
}

// cgroup2Root is where the cgroup v2 hierarchy is mounted: /sys/fs/cgroup on a
// pure v2 host, /sys/fs/cgroup/unified on a hybrid one.
func cgroup2Root() (string, error) {
	ms, err := procfs.Mounts()
	if err != nil {
		return "", fmt.Errorf("reading the mount table: %w", err)
	}
	for _, m := range ms {
		if m.FSType == "cgroup2" {
			return m.Point, nil
		}
	}
	return "", errors.New("no cgroup2 file system is mounted (none in /proc/self/mountinfo), so the run cannot hold its processes in a cgroup of its own: mount one (`mount -t cgroup2 none /sys/fs/cgroup/unified`) or boot with the unified hierarchy")
}

// ownCgroup is this process's cgroup v2 path (the 0:: line of /proc/self/cgroup).
func ownCgroup() (string, error) {
	b, err := os.ReadFile("/proc/self/cgroup")
	if err != nil {
		return "", err
	}
	for _, l := range strings.Split(string(b), "\n") {
		if p, ok := strings.CutPrefix(l, "0::"); ok {
			return p, nil
		}
	}
	return "", errors.New("/proc/self/cgroup has no cgroup v2 line (0::)")
}

// cgroupError says what failed and, for a refusal, what to do.
func cgroupError(what, root string, err error) error {
	if errors.Is(err, unix.EACCES) || errors.Is(err, unix.EPERM) || errors.Is(err, unix.EROFS) {
		return fmt.Errorf("%s: %w: the fidelity tests need to create and join cgroups under %s: run them as root with cgroup2 mounted read-write there (in a container: --privileged, or a private cgroup namespace with /sys/fs/cgroup writable)", what, err, root)
	}
	return fmt.Errorf("%s: %w", what, err)
}

// Run cgroup names round-trip, and only names runName makes are taken for a
// run's (a stray directory is never killed).
func TestRunName(t *testing.T) {
	pid, start, ok := parseRunName(runName(4242, 987654321))
	if !ok || pid != 4242 || start != 987654321 {
		t.Errorf("round trip: %d %d %v", pid, start, ok)
	}
	for _, name := range []string{"run-4242", "run-4242-", "run--5", "run-0-5", "run-x-5", "run-1-2-3",
		"run-+1-5", "run-1-99999999999999999999", "walk-1-2", "4242-5", "run-1--2"} {
		if pid, start, ok := parseRunName(name); ok {
			t.Errorf("%q parsed as run %d started at %d", name, pid, start)
		}
	}
}

// A run is stale when its PID is gone, a zombie, or another process (a start
// time that differs); an unreadable one is kept.
func TestStaleRun(t *testing.T) {
	procs := map[int]procfs.Stat{
		10: {State: 'S', StartTime: 500},
		11: {State: 'Z', StartTime: 500},
		12: {State: 'R', StartTime: 501},
	}
	stat := func(pid int) (procfs.Stat, error) {
		if pid == 13 {
			return procfs.Stat{}, errors.New("permission denied")
		}
		st, ok := procs[pid]
		if !ok {
			return procfs.Stat{}, fmt.Errorf("process %d: %w", pid, errdefs.ErrNotFound)
		}
		return st, nil
	}
	for _, c := range []struct {
		pid   int
		stale bool
	}{{10, false}, {11, true}, {12, true}, {13, false}, {14, true}} {
		if got := staleRun(c.pid, 500, stat); got != c.stale {
			t.Errorf("run %d started at 500: stale %v, want %v", c.pid, got, c.stale)
		}
	}
	// This process is live under its own name, and only under it.
	self, err := procfs.ReadStat(os.Getpid())
	if err != nil {
		t.Fatal(err)
	}
	if staleRun(os.Getpid(), self.StartTime, procfs.ReadStat) || !staleRun(os.Getpid(), self.StartTime+1, procfs.ReadStat) {
		t.Errorf("this process, started at %d: wrong liveness from /proc", self.StartTime)
	}
}
