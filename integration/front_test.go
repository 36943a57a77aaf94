package integration

import (
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	containerd "github.com/containerd/containerd/v2/client"

	"github.com/lazyfork/lazyfork/integration/harness"
	"github.com/lazyfork/lazyfork/internal/shimaddr"
)

// fullStartLog makes a bin directory whose front (a copy of bin's) runs a
// full shim that logs its argv before executing bin's: the file it returns
// then lists the commands the front ran the full binary for (the commands it
// hands on, the shim daemons it starts); the daemons and hooks the full
// binary starts itself are bin's full binary, unlogged.
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

// daemonsStarted returns the shim daemons' command lines in a fullStartLog:
// those with no action after the flags.
func daemonsStarted(t *testing.T, log string) [][]string {
	t.Helper()
	b, err := os.ReadFile(log)
	if err != nil && !os.IsNotExist(err) {
		t.Fatal(err)
	}
	var out [][]string
	for _, l := range strings.Split(string(b), "\n") {
		// containerd's commands name -publish-binary, runc's manager's
		// daemon command does not.
		if f := strings.Fields(l); len(f) > 0 && f[0] == "-namespace" && !slices.Contains(f, "-publish-binary") {
			out = append(out, f)
		}
	}
	return out
}

// TestFreshStartSpawnedByFront starts fresh containers (each its own shim)
// with containerd logging at info and at debug level: the front starts
// each shim daemon itself (the full binary's `start` never runs), with
// runc's manager's command line (-debug and a debug socket at debug level),
// and that shim serves the container: it runs, execs, and its deletion
// removes the shim and its sockets.
func TestFreshStartSpawnedByFront(t *testing.T) {
	for _, debug := range []bool{false, true} {
		t.Run(fmt.Sprintf("debug=%v", debug), func(t *testing.T) {
			dir, log := fullStartLog(t, lfBin(t))
			t.Setenv("LAZYFORK_BIN", dir)
			e := startLF(t, harness.Options{Debug: debug})
			ctx := e.ctx(t)
			img, err := e.ImportImage(ctx, "busybox")
			if err != nil {
				t.Fatal(err)
			}
			id := "fresh-" + lfRandom(3)
			ctr, task := e.run(t, ctx, img, id, []string{"sleep", "1000"})
			if n := fullStarts(t, log); n != 0 {
				b, _ := os.ReadFile(log)
				t.Errorf("a fresh container's start ran the full shim's `start` %d times, want none (the front starts its shim):\n%s", n, b)
			}
			want := []string{"-namespace", e.Namespace, "-id", id, "-address", e.Address}
			if debug {
				want = append(want, "-debug")
			}
			if d := daemonsStarted(t, log); len(d) != 1 || !slices.Equal(d[0], want) {
				t.Errorf("the front started shim daemons %q, want one: %q", d, want)
			}
			pid, ok := shimsByID(e.Address)[id]
			if !ok {
				t.Fatalf("no shim daemon serves %s", id)
			}
			if exe, err := os.Readlink(fmt.Sprintf("/proc/%d/exe", pid)); err != nil || filepath.Base(exe) != "containerd-shim-lazyfork-v1-full" {
				t.Errorf("shim %d runs %q %v, want the full shim", pid, exe, err)
			}
			if pgid, err := syscall.Getpgid(pid); err != nil || pgid != pid {
				t.Errorf("shim %d in process group %d %v, want its own", pid, pgid, err)
			}
			sockets := []string{shimaddr.Address(e.ShimSocketDir, e.Address, e.Namespace, id, false)}
			if debug {
				sockets = append(sockets, shimaddr.Address(e.ShimSocketDir, e.Address, e.Namespace, id, true))
			}
			for _, s := range sockets {
				if fi, err := os.Stat(strings.TrimPrefix(s, "unix://")); err != nil || fi.Mode()&os.ModeSocket == 0 || fi.Mode().Perm() != 0o600 {
					t.Errorf("shim socket %s: %v %v, want a socket, 0600", s, fi, err)
				}
			}

			if st, err := task.Status(ctx); err != nil || st.Status != containerd.Running {
				t.Fatalf("%s: status %v %v, want running", id, st.Status, err)
			}
			if out, code, err := e.execOut(ctx, task, "echo", "served"); err != nil || code != 0 || strings.TrimSpace(out) != "served" {
				t.Errorf("exec in %s: %q %d %v", id, out, code, err)
			}

			ch, err := task.Wait(ctx)
			if err != nil {
				t.Fatal(err)
			}
			if err := task.Kill(ctx, syscall.SIGKILL); err != nil {
				t.Fatal(err)
			}
			<-ch
			if _, err := task.Delete(ctx); err != nil {
				t.Fatal(err)
			}
			if err := ctr.Delete(ctx, containerd.WithSnapshotCleanup); err != nil {
				t.Fatal(err)
			}
			gone := func() bool {
				if _, still := shimsByID(e.Address)[id]; still {
					return false
				}
				for _, s := range sockets {
					if _, err := os.Lstat(strings.TrimPrefix(s, "unix://")); !os.IsNotExist(err) {
						return false
					}
				}
				return true
			}
			for i := 0; i < 1000 && !gone(); i++ {
				time.Sleep(10 * time.Millisecond)
			}
			if !gone() {
				t.Errorf("after the deletion of %s, its shim (%v) or its sockets remain: %v", id, shimsByID(e.Address)[id], sockets)
			}
		})
	}
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
	if n := fullStarts(t, log); n != 0 {
		t.Fatalf("the parent's start ran the full shim's `start` %d times, want none (the front starts its shim)", n)
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
	if got := fullStarts(t, log); got != 0 {
		b, _ := os.ReadFile(log)
		t.Errorf("%d forks of one batch ran the full shim's `start` %d times, want none (the front starts the batch's shim and answers the rest):\n%s", n, got, b)
	}
	if d := daemonsStarted(t, log); len(d) != 2 {
		b, _ := os.ReadFile(log)
		t.Errorf("the front started %d shim daemons for a parent and one batch, want 2:\n%s", len(d), b)
	}
}
