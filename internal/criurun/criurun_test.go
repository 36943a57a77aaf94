package criurun_test

import (
	"context"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/containerd/errdefs"

	"github.com/lazyfork/lazyfork/internal/criurun"
	"github.com/lazyfork/lazyfork/internal/procfs"
	"github.com/lazyfork/lazyfork/internal/testutil"
)

// counter prints 1, 2, 3... every 50 ms; as PID 1 of its namespace, it must trap
// nothing: the test stops it with SIGKILL.
const counter = `i=0; while :; do i=$((i+1)); echo $i; sleep 0.05; done`

func lastNumber(t *testing.T, path string) int {
	t.Helper()
	b, _ := os.ReadFile(path)
	fs := strings.Fields(string(b))
	if len(fs) == 0 {
		return 0
	}
	n, err := strconv.Atoi(fs[len(fs)-1])
	if err != nil {
		// A line may be half written: take the one before.
		if len(fs) > 1 {
			n, _ = strconv.Atoi(fs[len(fs)-2])
		}
	}
	return n
}

func waitFor(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(20 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// A workload started in its own PID namespace is dumped while it keeps running, and
// two copies restore side by side, each writing to its own file and counting on
// from where the parent was.
func TestDumpRestoreCopiesSideBySide(t *testing.T) {
	testutil.RequiresCRIU(t)
	if err := criurun.BecomeSubreaper(); err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	tmp := t.TempDir()
	out := filepath.Join(tmp, "parent.out")
	w, err := criurun.Start([]string{"/bin/sh", "-c", counter}, criurun.StartOptions{Stdout: out})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { w.Kill() })
	waitFor(t, "parent to count", func() bool { return lastNumber(t, out) >= 3 })

	img := filepath.Join(tmp, "img")
	d, err := criurun.Dump(ctx, w.PID, img, criurun.DumpOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if !d.PIDNS || d.ShellJob {
		t.Fatalf("meta: pidns=%v shelljob=%v, want true false", d.PIDNS, d.ShellJob)
	}
	atDump := lastNumber(t, out)
	if exited, err := w.Exited(); exited {
		t.Fatalf("parent stopped by a leave-running dump: %v", err)
	}

	var pids []int
	for i := 0; i < 2; i++ {
		cout := filepath.Join(tmp, "copy"+strconv.Itoa(i)+".out")
		r, err := criurun.Restore(ctx, img, criurun.RestoreOptions{Stdout: cout})
		if err != nil {
			t.Fatal(err)
		}
		pids = append(pids, r.PID)
		t.Cleanup(func() { criurun.Kill(r.PID) })
		if ok, err := procfs.IsPIDNSInit(r.PID); err != nil || !ok {
			t.Fatalf("copy %d (pid %d) is not a namespace init: %v", i, r.PID, err)
		}
		waitFor(t, "copy to count", func() bool { return lastNumber(t, cout) > 0 })
		first := strings.Fields(mustRead(t, cout))[0]
		n, _ := strconv.Atoi(first)
		// The copy goes on from the dump: its first number follows one the parent
		// printed before the dump finished, and is not a fresh start at 1.
		if n < 2 || n > atDump+1 {
			t.Fatalf("copy %d starts at %d; parent was at %d at dump time", i, n, atDump)
		}
	}
	if pids[0] == pids[1] {
		t.Fatal("two copies with one pid")
	}
	m, err := procfs.TreeMem(pids[0])
	if err != nil || m.RssAnon == 0 || m.Pss == 0 {
		t.Fatalf("TreeMem: %+v, %v", m, err)
	}
	for _, p := range pids {
		if err := criurun.Kill(p); err != nil {
			t.Fatal(err)
		}
		if _, err := os.Stat("/proc/" + strconv.Itoa(p)); err == nil {
			t.Fatalf("pid %d still there after Kill", p)
		}
	}
}

func TestDumpErrors(t *testing.T) {
	ctx := context.Background()
	if _, err := criurun.Dump(ctx, 0, t.TempDir(), criurun.DumpOptions{}); !errors.Is(err, errdefs.ErrInvalidArgument) {
		t.Fatalf("pid 0: %v", err)
	}
	if _, err := criurun.Restore(ctx, t.TempDir(), criurun.RestoreOptions{}); !errors.Is(err, errdefs.ErrNotFound) {
		t.Fatalf("empty dir: %v", err)
	}
	if _, err := criurun.Start(nil, criurun.StartOptions{}); !errors.Is(err, errdefs.ErrInvalidArgument) {
		t.Fatalf("empty command: %v", err)
	}
}

// A failing restore quotes CRIU's log.
func TestRestoreErrorQuotesLog(t *testing.T) {
	testutil.RequiresCRIU(t)
	dir := t.TempDir()
	// An inventory CRIU cannot parse.
	if err := os.WriteFile(filepath.Join(dir, "inventory.img"), []byte("garbage!"), 0o644); err != nil {
		t.Fatal(err)
	}
	_, err := criurun.Restore(context.Background(), dir, criurun.RestoreOptions{WorkDir: t.TempDir()})
	if err == nil || !strings.Contains(err.Error(), "Error") {
		t.Fatalf("want an error quoting CRIU's log, got %v", err)
	}
	t.Log(err)
}

func mustRead(t *testing.T, p string) string {
	t.Helper()
	b, err := os.ReadFile(p)
	if err != nil {
		t.Fatal(err)
	}
	return string(b)
}

// CRIU cannot dump a PID namespace whose init's session leader is outside it; Dump
// says so and how to start the program instead of quoting CRIU's log.
func TestDumpRefusesSessionOutsideNamespace(t *testing.T) {
	testutil.RequiresCRIU(t)
	cmd := exec.Command("/bin/sleep", "60")
	cmd.SysProcAttr = &syscall.SysProcAttr{Cloneflags: syscall.CLONE_NEWPID}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	defer func() { cmd.Process.Kill(); cmd.Wait() }()
	_, err := criurun.Dump(context.Background(), cmd.Process.Pid, t.TempDir(), criurun.DumpOptions{})
	if !errors.Is(err, errdefs.ErrInvalidArgument) || !strings.Contains(err.Error(), "setsid") {
		t.Fatalf("want an invalid-argument error naming setsid, got %v", err)
	}
}
