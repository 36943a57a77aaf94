package integration

import (
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"

	containerd "github.com/containerd/containerd/v2/client"
)

// fullStartLog makes a bin directory whose front (a copy of bin's) runs a
// full shim that logs its argv before executing bin's: the file it returns
// then lists the commands the full binary ran for containerd (the daemons and
// hooks it starts are bin's full binary itself, unlogged).
func fullStartLog(t *testing.T, bin string) (dir, log string) {
	t.Helper()
	dir, err := os.MkdirTemp("/tmp", "lff-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	// A copy, not a link: the front finds the full shim beside its own
	// executable, links resolved.
	front, err := os.ReadFile(filepath.Join(bin, "containerd-shim-lazyfork-v1"))
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(dir, "containerd-shim-lazyfork-v1"), front, 0o755); err != nil {
		t.Fatal(err)
	}
	for _, b := range []string{"lazyfork", "lazyfork-snapshotter", "lazyfork-memfile"} {
		if err := os.Symlink(filepath.Join(bin, b), filepath.Join(dir, b)); err != nil {
			t.Fatal(err)
		}
	}
	log = filepath.Join(dir, "full.log")
	script := fmt.Sprintf("#!/bin/sh\necho \"$*\" >>%s\nexec %s \"$@\"\n", log, filepath.Join(bin, "containerd-shim-lazyfork-v1-full"))
	if err := os.WriteFile(filepath.Join(dir, "containerd-shim-lazyfork-v1-full"), []byte(script), 0o755); err != nil {
		t.Fatal(err)
	}
	return dir, log
}

// fullStarts counts the `start` commands in a fullStartLog.
func fullStarts(t *testing.T, log string) int {
	t.Helper()
	b, err := os.ReadFile(log)
	if err != nil && !os.IsNotExist(err) {
		t.Fatal(err)
	}
	n := 0
	for _, l := range strings.Split(string(b), "\n") {
		if f := strings.Fields(l); len(f) > 0 && f[len(f)-1] == "start" {
			n++
		}
	}
	return n
}

// TestForkBatchStartsServedByFront forks a batch into one shim: containerd
// runs `shim start` for every fork, and only the first needs the full shim
// (it starts the batch's shim); the front answers the others, and every fork
// runs in that one shim.
func TestForkBatchStartsServedByFront(t *testing.T) {
	dir, log := fullStartLog(t, lfBin(t))
	t.Setenv("LAZYFORK_BIN", dir)
	e, ctx, img := startLFPython(t)
	parent := e.startCounter(t, ctx, img, "par-"+lfRandom(4), 16)
	if n := fullStarts(t, log); n != 1 {
		t.Fatalf("the parent's start ran the full shim %d times, want 1 (its own shim)", n)
	}

	const n = 6
	res, err := e.lfClient().Fork(ctx, parent.id, n, e.logIO())
	if err != nil {
		t.Fatal(err)
	}
	forks := e.forks(res)
	for _, f := range forks {
		checkContinues(t, ctx, parent, f)
		if st, err := f.task.Status(ctx); err != nil || st.Status != containerd.Running {
			t.Errorf("%s: status %v %v", f.id, st.Status, err)
		}
	}
	shims := shimsByID(e.Address)
	if len(shims) != 2 {
		t.Errorf("%d shim processes serve the parent and %d forks of one batch, want 2: %v", len(shims), n, shims)
	}
	if got := fullStarts(t, log) - 1; got != 1 {
		b, _ := os.ReadFile(log)
		t.Errorf("%d forks of one batch ran the full shim's `start` %d times, want once (the front answers the rest):\n%s", n, got, b)
	}
}
