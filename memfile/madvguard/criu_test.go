package madvguard_test

import (
	"bufio"
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
	"github.com/lazyfork/lazyfork/internal/testutil"
	"github.com/lazyfork/lazyfork/memfile/madvguard"
)

// Real CRIU: a two-threaded probe is dumped, guarded and restored; the copy's
// madvise must fail inside the dumped data and work elsewhere, its own
// filters must still apply, the original must keep purging, and a copy of
// the copy must carry exactly one guard.

func buildProbe(t *testing.T) string {
	t.Helper()
	testutil.RequiresBinary(t, "gcc")
	bin := filepath.Join(t.TempDir(), "probe")
	if out, err := exec.Command("gcc", "-O2", "-Wall", "-pthread", "-o", bin, "testdata/probe.c").CombinedOutput(); err != nil {
		t.Fatalf("gcc probe.c: %v\n%s", err, out)
	}
	return bin
}

// probeLine waits for a report line of the probe written after skip lines.
func probeLine(t *testing.T, path string, skip int) map[string]string {
	t.Helper()
	deadline := time.Now().Add(20 * time.Second)
	for time.Now().Before(deadline) {
		f, err := os.Open(path)
		if err == nil {
			var lines []string
			sc := bufio.NewScanner(f)
			for sc.Scan() {
				if strings.HasPrefix(sc.Text(), "probe in=") {
					lines = append(lines, sc.Text())
				}
			}
			f.Close()
			if len(lines) > skip+1 {
				// The second to last line is complete for sure.
				kv := map[string]string{}
				for _, f := range strings.Fields(lines[len(lines)-2])[1:] {
					k, v, _ := strings.Cut(f, "=")
					kv[k] = v
				}
				return kv
			}
		}
		time.Sleep(50 * time.Millisecond)
	}
	b, _ := os.ReadFile(path)
	t.Fatalf("no probe report in %s:\n%s", path, b)
	return nil
}

func lineCount(path string) int {
	b, _ := os.ReadFile(path)
	return strings.Count(string(b), "probe in=")
}

func expect(t *testing.T, who string, got map[string]string, want map[string]string) {
	t.Helper()
	for k, v := range want {
		if got[k] != v {
			t.Errorf("%s: %s=%s, want %s (line %v)", who, k, got[k], v, got)
		}
	}
}

func guards(t *testing.T, dir string) []madvguard.Thread {
	t.Helper()
	ts, err := madvguard.Inspect(dir)
	if err != nil {
		t.Fatal(err)
	}
	return ts
}

func TestGuardThroughCRIU(t *testing.T) {
	testutil.RequiresCRIU(t)
	probe := buildProbe(t)
	if err := criurun.BecomeSubreaper(); err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		name string
		args []string
		own  string // errno of the probe's own filtered call
		base int    // filters the probe installs on its main thread
	}{
		{"no-filters", nil, "EINVAL", 0},
		{"own-filter", []string{"-f"}, "EXFULL", 1},
		{"per-thread-chains", []string{"-f", "-F"}, "EXFULL", 1},
	} {
		t.Run(tc.name, func(t *testing.T) {
			ctx := context.Background()
			tmp := t.TempDir()
			out := filepath.Join(tmp, "parent.out")
			w, err := criurun.Start(append([]string{probe}, tc.args...), criurun.StartOptions{Stdout: out})
			if err != nil {
				t.Fatal(err)
			}
			defer w.Kill()
			probeLine(t, out, 0)

			img := filepath.Join(tmp, "img")
			if _, err := criurun.Dump(ctx, w.PID, img, criurun.DumpOptions{}); err != nil {
				t.Fatal(err)
			}
			ranges, err := madvguard.AnonRanges(img)
			if err != nil {
				t.Fatal(err)
			}
			if len(ranges[1]) == 0 {
				t.Fatalf("no data ranges for pid 1: %v", ranges)
			}
			if ok, err := madvguard.Installed(img); err != nil || ok {
				t.Fatalf("Installed before Apply = %v, %v", ok, err)
			}
			checkStagingSafe(t, img, ranges)
			if err := madvguard.Apply(img, ranges); err != nil {
				t.Fatal(err)
			}
			before, _ := os.ReadFile(filepath.Join(img, "seccomp.img"))
			if err := madvguard.Apply(img, ranges); err != nil { // idempotent
				t.Fatal(err)
			}
			after, _ := os.ReadFile(filepath.Join(img, "seccomp.img"))
			if string(before) != string(after) {
				t.Errorf("a second Apply changed seccomp.img (%d -> %d bytes)", len(before), len(after))
			}
			if ok, err := madvguard.Installed(img); err != nil || !ok {
				t.Fatalf("Installed after Apply = %v, %v", ok, err)
			}
			checkOneGuard(t, img)

			copyOut := filepath.Join(tmp, "copy.out")
			r, err := criurun.Restore(ctx, img, criurun.RestoreOptions{Stdout: copyOut})
			if err != nil {
				t.Fatal(err)
			}
			defer criurun.Kill(r.PID)
			filters := strconv.Itoa(tc.base + 1)
			expect(t, "copy", probeLine(t, copyOut, 1), map[string]string{
				"in": "EINVAL", "free": "EINVAL", "out": "ok", "data": "ok",
				"own": tc.own, "filters": filters, "t2in": "EINVAL", "t2own": tc.own,
			})
			expect(t, "original", probeLine(t, out, lineCount(out)), map[string]string{
				"in": "ok", "free": "ok", "out": "ok", "data": "ok", "own": tc.own,
				"filters": strconv.Itoa(tc.base), "t2in": "ok",
			})

			// A copy of the copy: its dump carries the guard from the kernel;
			// Apply replaces it, never stacks a second one.
			img2 := filepath.Join(tmp, "img2")
			if _, err := criurun.Dump(ctx, r.PID, img2, criurun.DumpOptions{}); err != nil {
				t.Fatal(err)
			}
			checkOneGuard(t, img2)
			ranges2, err := madvguard.AnonRanges(img2)
			if err != nil {
				t.Fatal(err)
			}
			if err := madvguard.Apply(img2, ranges2); err != nil {
				t.Fatal(err)
			}
			checkOneGuard(t, img2)
			grandOut := filepath.Join(tmp, "grandchild.out")
			r2, err := criurun.Restore(ctx, img2, criurun.RestoreOptions{Stdout: grandOut})
			if err != nil {
				t.Fatal(err)
			}
			defer criurun.Kill(r2.PID)
			expect(t, "copy of the copy", probeLine(t, grandOut, 1), map[string]string{
				"in": "EINVAL", "free": "EINVAL", "out": "ok", "data": "ok",
				"own": tc.own, "filters": filters, "t2in": "EINVAL", "t2own": tc.own,
			})

			// Removing the guard (no ranges) gives back the plain image.
			if err := madvguard.Apply(img2, nil); err != nil {
				t.Fatal(err)
			}
			if ok, _ := madvguard.Installed(img2); ok {
				t.Error("guard still installed after Apply with no ranges")
			}
		})
	}
}

// checkOneGuard asserts that every thread carrying filters has exactly one
// guard, and that every thread is covered (its own chain or the leader's
// TSYNC chain).
func checkOneGuard(t *testing.T, dir string) {
	t.Helper()
	ts := guards(t, dir)
	leaderTSync := map[int]bool{}
	for _, th := range ts {
		if th.Tid == th.Pid {
			leaderTSync[th.Pid] = th.TSync
		}
	}
	for _, th := range ts {
		switch {
		case th.Filters == 0 && leaderTSync[th.Pid]:
		case th.Guards != 1:
			t.Errorf("thread %d/%d: %d guards in %d filters, want exactly 1 (%+v)", th.Pid, th.Tid, th.Guards, th.Filters, ts)
		}
	}
	if testing.Verbose() {
		t.Logf("%s: %s", filepath.Base(dir), fmt.Sprint(ts))
	}
}

// Zero mode: without a supervisor the copy's purges fail (ENOSYS); with one
// they succeed and the range reads zeros; the supervisor detaches for a
// dump of the copy and attaches again.
func TestZeroModeThroughCRIU(t *testing.T) {
	testutil.RequiresCRIU(t)
	probe := buildProbe(t)
	if err := criurun.BecomeSubreaper(); err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	tmp := t.TempDir()
	out := filepath.Join(tmp, "parent.out")
	w, err := criurun.Start([]string{probe, "-f", "-c"}, criurun.StartOptions{Stdout: out})
	if err != nil {
		t.Fatal(err)
	}
	defer w.Kill()
	probeLine(t, out, 0)
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
	for _, th := range guards(t, img) {
		if th.Guards == 1 && th.Mode != madvguard.Zero {
			t.Fatalf("guard mode %v, want zero", th.Mode)
		}
	}
	copyOut := filepath.Join(tmp, "copy.out")
	r, err := criurun.Restore(ctx, img, criurun.RestoreOptions{Stdout: copyOut})
	if err != nil {
		t.Fatal(err)
	}
	defer criurun.Kill(r.PID)
	unsupervised := map[string]string{"in": "ENOSYS", "free": "ENOSYS", "out": "ok", "data": "ok", "own": "EXFULL", "t2in": "ENOSYS", "t3in": "ENOSYS", "filters": "2"}
	expect(t, "unsupervised copy", probeLine(t, copyOut, 1), unsupervised)

	sup, err := madvguard.SpawnSupervisor(r.PID)
	if err != nil {
		t.Fatal(err)
	}
	defer sup.Close()
	// t3in: a thread born under the supervisor is traced too (clone events).
	supervised := map[string]string{"in": "ok", "free": "ok", "out": "ok", "data": "ok", "own": "EXFULL", "t2in": "ok", "t3in": "ok", "filters": "2"}
	expect(t, "supervised copy", probeLine(t, copyOut, lineCount(copyOut)+1), supervised)
	st, err := sup.Stats()
	if err != nil || st.Zeroed == 0 {
		t.Fatalf("supervisor stats %+v, %v: nothing zeroed", st, err)
	}
	t.Logf("supervisor: %+v (%.1f us per stop)", st, float64(st.Busy.Microseconds())/float64(max(st.Zeroed, 1)))

	// A supervised copy stays forkable: detach, dump, attach.
	if err := sup.Detach(); err != nil {
		t.Fatal(err)
	}
	img2 := filepath.Join(tmp, "img2")
	if _, err := criurun.Dump(ctx, r.PID, img2, criurun.DumpOptions{}); err != nil {
		t.Fatal(err)
	}
	if err := sup.Attach(); err != nil {
		t.Fatal(err)
	}
	expect(t, "copy after re-attach", probeLine(t, copyOut, lineCount(copyOut)+1), supervised)
	checkOneGuard(t, img2)
	ranges2, err := madvguard.AnonRanges(img2)
	if err != nil {
		t.Fatal(err)
	}
	if err := madvguard.ApplyMode(img2, ranges2, madvguard.Zero); err != nil {
		t.Fatal(err)
	}
	checkOneGuard(t, img2)
	grandOut := filepath.Join(tmp, "grandchild.out")
	r2, err := criurun.Restore(ctx, img2, criurun.RestoreOptions{Stdout: grandOut})
	if err != nil {
		t.Fatal(err)
	}
	defer criurun.Kill(r2.PID)
	expect(t, "copy of the copy", probeLine(t, grandOut, 1), unsupervised)
	if err := sup.Close(); err != nil {
		t.Fatal(err)
	}
}

// checkStagingSafe applies the guard to a hard-linked copy of img (as a
// rewrite's staging directory is) and checks that img is untouched.
func checkStagingSafe(t *testing.T, img string, ranges map[int][]madvguard.Range) {
	t.Helper()
	linked := img + ".linked"
	if err := os.Mkdir(linked, 0o700); err != nil {
		t.Fatal(err)
	}
	defer os.RemoveAll(linked)
	ents, _ := os.ReadDir(img)
	before := map[string]string{}
	for _, e := range ents {
		b, _ := os.ReadFile(filepath.Join(img, e.Name()))
		before[e.Name()] = string(b)
		if err := os.Link(filepath.Join(img, e.Name()), filepath.Join(linked, e.Name())); err != nil {
			t.Fatal(err)
		}
	}
	if err := madvguard.Apply(linked, ranges); err != nil {
		t.Fatal(err)
	}
	if ok, _ := madvguard.Installed(linked); !ok {
		t.Fatal("no guard in the linked copy")
	}
	for name, b := range before {
		if now, _ := os.ReadFile(filepath.Join(img, name)); string(now) != b {
			t.Errorf("Apply on a hard-linked copy changed the original %s", name)
		}
	}
}

// A tree holding a zombie (any shell that ran a background job) gets its
// guard: CRIU 4.1.1 leaves a dead task's thread ids unset in pstree.img, with
// no core image behind them, and the guard must not look for one (issue 13).
func TestGuardWithZombie(t *testing.T) {
	testutil.RequiresCRIU(t)
	if err := criurun.BecomeSubreaper(); err != nil {
		t.Fatal(err)
	}
	w, err := criurun.Start([]string{"sh", "-c", "true & exec sleep 1000"}, criurun.StartOptions{})
	if err != nil {
		t.Fatal(err)
	}
	defer w.Kill()
	// sleep (pid 1 of its namespace) never reaps the exited `true`.
	zombie := false
	for i := 0; i < 200 && !zombie; i++ {
		b, _ := os.ReadFile(fmt.Sprintf("/proc/%d/task/%d/children", w.PID, w.PID))
		for _, c := range strings.Fields(string(b)) {
			st, _ := os.ReadFile("/proc/" + c + "/stat")
			if i := strings.LastIndexByte(string(st), ')'); i > 0 && strings.HasPrefix(string(st[i+1:]), " Z") {
				zombie = true
			}
		}
		time.Sleep(10 * time.Millisecond)
	}
	if !zombie {
		t.Fatal("no zombie in the tree")
	}
	img := filepath.Join(t.TempDir(), "img")
	if _, err := criurun.Dump(context.Background(), w.PID, img, criurun.DumpOptions{}); err != nil {
		t.Fatal(err)
	}
	ranges, err := madvguard.AnonRanges(img)
	if err != nil {
		t.Fatalf("ranges of a tree with a zombie: %v", err)
	}
	if err := madvguard.Apply(img, ranges); err != nil {
		t.Fatalf("guard of a tree with a zombie: %v", err)
	}
	if ok, err := madvguard.Installed(img); err != nil || !ok {
		t.Fatalf("Installed after Apply = %v, %v", ok, err)
	}
}
