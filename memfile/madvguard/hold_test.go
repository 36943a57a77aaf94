package madvguard_test

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

	"github.com/lazyfork/lazyfork/internal/criurun"
	"github.com/lazyfork/lazyfork/internal/procfs"
	"github.com/lazyfork/lazyfork/internal/testutil"
	"github.com/lazyfork/lazyfork/memfile/madvguard"
)

// purgeCounts reads the last complete "purges" line of a purgeloop output.
func purgeCounts(t *testing.T, path string) map[string]string {
	t.Helper()
	b, _ := os.ReadFile(path)
	lines := strings.Split(string(b), "\n")
	for i := len(lines) - 2; i >= 0; i-- { // the last element follows the last newline
		if f := strings.Fields(lines[i]); len(f) > 1 && f[0] == "purges" {
			kv := map[string]string{}
			for _, x := range f[1:] {
				k, v, _ := strings.Cut(x, "=")
				kv[k] = v
			}
			return kv
		}
	}
	t.Fatalf("no purges line in %s:\n%s", path, b)
	return nil
}

// waitPurges waits until the purgeloop at path reports more than n calls.
func waitPurges(t *testing.T, path string, n uint64) map[string]string {
	t.Helper()
	deadline := time.Now().Add(20 * time.Second)
	for {
		b, _ := os.ReadFile(path)
		if strings.Contains(string(b), "purges ") {
			kv := purgeCounts(t, path)
			if got, _ := strconv.ParseUint(kv["n"], 10, 64); got > n {
				return kv
			}
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s: no more than %d purges", path, n)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// freezer is a freezer cgroup of the test's own (v2, or v1's freezer).
type freezer struct{ dir string }

func newFreezer(t *testing.T) *freezer {
	t.Helper()
	name := fmt.Sprintf("lazyfork-madvguard-test-%d", os.Getpid())
	dir := filepath.Join("/sys/fs/cgroup", name)
	if _, err := os.Stat("/sys/fs/cgroup/cgroup.controllers"); err != nil {
		dir = filepath.Join("/sys/fs/cgroup/freezer", name)
	}
	if err := os.Mkdir(dir, 0o755); err != nil {
		t.Fatalf("freezer cgroup: %v", err)
	}
	f := &freezer{dir: dir}
	t.Cleanup(func() {
		f.set(t, false)
		// Its processes are killed by then; the directory goes once empty.
		for i := 0; i < 100 && os.Remove(dir) != nil; i++ {
			time.Sleep(20 * time.Millisecond)
		}
	})
	return f
}

func (f *freezer) v2() bool { return !strings.HasPrefix(f.dir, "/sys/fs/cgroup/freezer/") }

func (f *freezer) add(t *testing.T, pid int) {
	t.Helper()
	tree, err := procfs.Tree(pid)
	if err != nil {
		t.Fatal(err)
	}
	for _, p := range tree {
		if err := os.WriteFile(filepath.Join(f.dir, "cgroup.procs"), []byte(strconv.Itoa(p)), 0o644); err != nil {
			t.Fatalf("move %d into %s: %v", p, f.dir, err)
		}
	}
}

// set freezes or thaws the cgroup and waits until it is done.
func (f *freezer) set(t *testing.T, frozen bool) {
	t.Helper()
	file, val, done := "freezer.state", "THAWED", func(s string) bool { return strings.TrimSpace(s) == "THAWED" }
	if frozen {
		val, done = "FROZEN", func(s string) bool { return strings.TrimSpace(s) == "FROZEN" }
	}
	if f.v2() {
		file, val = "cgroup.freeze", "0"
		want := "frozen 0"
		if frozen {
			val, want = "1", "frozen 1"
		}
		done = func(string) bool {
			b, _ := os.ReadFile(filepath.Join(f.dir, "cgroup.events"))
			return strings.Contains(string(b), want)
		}
	}
	if err := os.WriteFile(filepath.Join(f.dir, file), []byte(val), 0o644); err != nil {
		t.Fatalf("%s %s: %v", f.dir, val, err)
	}
	deadline := time.Now().Add(10 * time.Second)
	for {
		b, _ := os.ReadFile(filepath.Join(f.dir, file))
		if done(string(b)) {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s: not %s after 10s (%s)", f.dir, val, b)
		}
		time.Sleep(time.Millisecond)
	}
}

// A supervised copy that purges all the time is paused and resumed, again
// and again, as the shim does around each snapshot of it: Hold, freeze,
// Release; then Attach while frozen, thaw. Not one purge may fail: a thread
// that ran untraced between the detach and the freeze, or between the thaw
// and the attach, would get ENOSYS from the zero-mode guard.
func TestHoldAcrossFreeze(t *testing.T) {
	testutil.RequiresCRIU(t)
	testutil.RequiresBinary(t, "gcc")
	if err := criurun.BecomeSubreaper(); err != nil {
		t.Fatal(err)
	}
	tmp := t.TempDir()
	bin := filepath.Join(tmp, "purgeloop")
	if out, err := exec.Command("gcc", "-O2", "-Wall", "-o", bin, "testdata/purgeloop.c").CombinedOutput(); err != nil {
		t.Fatalf("gcc purgeloop.c: %v\n%s", err, out)
	}
	ctx := context.Background()
	out := filepath.Join(tmp, "parent.out")
	w, err := criurun.Start([]string{bin}, criurun.StartOptions{Stdout: out})
	if err != nil {
		t.Fatal(err)
	}
	defer w.Kill()
	waitPurges(t, out, 0)
	img := filepath.Join(tmp, "img")
	if _, err := criurun.Dump(ctx, w.PID, img, criurun.DumpOptions{}); err != nil {
		t.Fatal(err)
	}
	ranges, err := madvguard.AnonRanges(img)
	if err != nil {
		t.Fatal(err)
	}
	if err := madvguard.ApplyMode(img, ranges, madvguard.Zero); err != nil {
		t.Fatal(err)
	}
	copyOut := filepath.Join(tmp, "copy.out")
	r, err := criurun.Restore(ctx, img, criurun.RestoreOptions{Stdout: copyOut})
	if err != nil {
		t.Fatal(err)
	}
	defer criurun.Kill(r.PID)
	fz := newFreezer(t)
	fz.add(t, r.PID)
	sup, err := madvguard.SpawnSupervisor(r.PID)
	if err != nil {
		t.Fatal(err)
	}
	defer sup.Close()
	// What went wrong before the supervisor attached is not this test's.
	base := waitPurges(t, copyOut, 0)
	n0, _ := strconv.ParseUint(base["n"], 10, 64)
	base = waitPurges(t, copyOut, n0+1000)
	n, _ := strconv.ParseUint(base["n"], 10, 64)
	for i := 0; i < 30; i++ {
		if err := sup.Hold(); err != nil {
			t.Fatalf("cycle %d: hold: %v", i, err)
		}
		fz.set(t, true)
		if err := sup.Release(); err != nil {
			t.Fatalf("cycle %d: release: %v", i, err)
		}
		if err := sup.Attach(); err != nil {
			t.Fatalf("cycle %d: attach while frozen: %v", i, err)
		}
		fz.set(t, false)
		kv := waitPurges(t, copyOut, n+200)
		n, _ = strconv.ParseUint(kv["n"], 10, 64)
	}
	end := purgeCounts(t, copyOut)
	if end["bad"] != base["bad"] || end["stale"] != base["stale"] {
		t.Fatalf("across 30 pauses of a supervised copy: %v, before them %v: purges failed or left data", end, base)
	}
	st, err := sup.Stats()
	if err != nil || st.Zeroed == 0 {
		t.Fatalf("supervisor stats %+v, %v: nothing zeroed", st, err)
	}
	t.Logf("%v; supervisor %+v", end, st)
}
