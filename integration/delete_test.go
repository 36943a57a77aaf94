package integration

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	containerd "github.com/containerd/containerd/v2/client"

	lfclient "github.com/lazyfork/lazyfork/client"
)

// TestFrontAnswersDelete: containerd runs the shim binary's `delete` after
// every task delete. For a task the full shim's Delete RPC deleted and
// released, the front answers it from the bundle (internal/shimaddr's DeletedFile) and
// the full shim never runs: forks deleted alone, beside a fork that shares
// their shim, and a shim's last fork leave nothing behind (runc's state
// included). A fork whose shim was killed has had no Delete RPC: its
// `delete` is the full shim's, which cleans up after it.
func TestFrontAnswersDelete(t *testing.T) {
	bin, deletes := spyFullShimDeletes(t)
	t.Setenv("LAZYFORK_BIN", bin)
	e, ctx, img := startLFPython(t)
	parent := e.startCounter(t, ctx, img, "par-"+lfRandom(4), 64)
	lf := lfclient.New(e.Client(), lfclient.WithRoot(e.Root), lfclient.WithShimGroupSize(2))
	res, err := lf.Fork(ctx, parent.id, 3, e.logIO())
	if err != nil {
		t.Fatal(err)
	}
	forks := e.forks(res)
	for _, f := range forks {
		checkContinues(t, ctx, parent, f)
	}
	// Groups of two: forks 0 and 1 share a shim, fork 2 has its own.
	shims := shimsByID(e.Address)
	if _, ok := shims[forks[2].id]; !ok || e.bundleFile(t, forks[1].id, "sandbox") != forks[0].id {
		t.Fatalf("forks %v: shims %v, fork 1's sandbox %q; want forks 0 and 1 in one shim", counterIDs(forks), shims, e.bundleFile(t, forks[1].id, "sandbox"))
	}

	// Fork 0 leaves fork 1 in its shim; fork 2 is its shim's last task.
	for _, f := range []*counter{forks[0], forks[2]} {
		st, err := f.task.Delete(ctx, containerd.WithProcessKill)
		if err != nil {
			t.Fatalf("delete %s's task: %v", f.id, err)
		}
		if code := st.ExitCode(); code != 128+uint32(syscall.SIGKILL) {
			t.Errorf("%s's task deleted with exit status %d, want %d (SIGKILL)", f.id, code, 128+uint32(syscall.SIGKILL))
		}
		if err := lf.Delete(ctx, f.id); err != nil {
			t.Fatal(err)
		}
	}
	if got := deletes(); got != "" {
		t.Errorf("the full shim ran `delete` for tasks its Delete RPC had deleted:\n%s", got)
	}
	forks[1].waitLine(t, ctx, len(forks[1].lines(t)), "tick ")

	// Killed with its shim, fork 1 has no delete record: the full shim's
	// `delete` runs (runc's cleanup and LazyFork's release).
	if err := syscall.Kill(shimsByID(e.Address)[forks[0].id], syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	// containerd removes the bundle once that `delete` is over.
	bundle := filepath.Join(e.State, "io.containerd.runtime.v2.task", e.Namespace, forks[1].id)
	deadline := time.Now().Add(30 * time.Second)
	for _, err := os.Stat(bundle); err == nil; _, err = os.Stat(bundle) {
		if time.Now().After(deadline) {
			t.Fatalf("30 s after fork %s's shim was killed, its bundle is still there", forks[1].id)
		}
		time.Sleep(50 * time.Millisecond)
	}
	if !strings.Contains(deletes(), "-id "+forks[1].id+" ") {
		t.Errorf("fork %s's shim was killed and its bundle removed without the full shim's `delete` (ran for: %q)", forks[1].id, deletes())
	}
	if err := lf.Delete(ctx, forks[1].id); err != nil {
		t.Fatal(err)
	}
	e.assertNothingLeft(t, ctx, parent.id, res.Family, counterIDs(forks))
}

// spyFullShimDeletes copies LazyFork's binaries to a directory of the test's
// whose full shim logs every `delete` it is run for before it runs; deletes
// returns that log.
func spyFullShimDeletes(t *testing.T) (dir string, deletes func() string) {
	t.Helper()
	dir = filepath.Join(t.TempDir(), "bin")
	if out, err := exec.Command("cp", "-a", lfBin(t), dir).CombinedOutput(); err != nil {
		t.Fatalf("copy the binaries: %v\n%s", err, out)
	}
	full := filepath.Join(dir, "containerd-shim-lazyfork-v1-full")
	if err := os.Rename(full, full+".real"); err != nil {
		t.Fatal(err)
	}
	log := filepath.Join(dir, "deletes.log")
	script := fmt.Sprintf("#!/bin/sh\ncase \" $* \" in *\" delete \") echo \"$*\" >>%s;; esac\nexec %s.real \"$@\"\n", log, full)
	if err := os.WriteFile(full, []byte(script), 0o755); err != nil {
		t.Fatal(err)
	}
	return dir, func() string {
		b, _ := os.ReadFile(log)
		return string(b)
	}
}
