package integration

import (
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	containerd "github.com/containerd/containerd/v2/client"
	"github.com/containerd/containerd/v2/pkg/cio"
	specs "github.com/opencontainers/runtime-spec/specs-go"

	"github.com/lazyfork/lazyfork/integration/harness"
	"github.com/lazyfork/lazyfork/internal/procfs"
)

// TestSnapshotPauseInShim: a snapshot's pause (the client's intent,
// lazyforkv1.SnapshotIntent.freeze_in_shim) freezes the task in the shim,
// without runc, and looks like runc's pause to everyone: the task says
// PAUSED, its cgroup is frozen (runc's own test of paused), it makes no
// progress, the paused and resumed events come, a second Pause and an exec
// are refused, and Resume lets it count on. A task killed while so frozen ends. A Pause
// without the intent is still runc's.
func TestSnapshotPauseInShim(t *testing.T) {
	e := startLF(t, harness.Options{Debug: true})
	ctx := e.ctx(t)
	img, err := e.ImportImage(ctx, "python")
	if err != nil {
		t.Fatal(err)
	}
	c := e.startCounter(t, ctx, img, "inshim-"+lfRandom(3), 16)
	evs, evErrs := e.Client().Subscribe(ctx, `topic~="/tasks/(paused|resumed)"`)
	nextEvent := func(want string) {
		t.Helper()
		select {
		case ev := <-evs:
			if ev.Topic != want {
				t.Errorf("event %s, want %s", ev.Topic, want)
			}
		case err := <-evErrs:
			t.Fatalf("events: %v", err)
		case <-time.After(30 * time.Second):
			t.Errorf("no %s event", want)
		}
	}
	intent := func() {
		t.Helper()
		sendSnapshotIntent(t, ctx, e, c.id)
	}
	status := func(want containerd.ProcessStatus) {
		t.Helper()
		st, err := c.task.Status(ctx)
		if err != nil || st.Status != want {
			t.Fatalf("status %v (%v), want %v", st.Status, err, want)
		}
	}
	cg, v1, err := procfs.Cgroup(int(c.task.Pid()), "freezer")
	if err != nil {
		t.Fatal(err)
	}
	frozen := func() bool {
		t.Helper()
		file := filepath.Join("/sys/fs/cgroup", cg, "cgroup.freeze")
		if v1 {
			file = filepath.Join("/sys/fs/cgroup/freezer", cg, "freezer.state")
		}
		b, err := os.ReadFile(file)
		if err != nil {
			t.Fatal(err)
		}
		s := strings.TrimSpace(string(b))
		return s == "FROZEN" || s == "1"
	}
	pauseResume := func(inShim bool) {
		t.Helper()
		logFrom := len(e.Log())
		if inShim {
			intent()
		}
		if err := c.task.Pause(ctx); err != nil {
			t.Fatal(err)
		}
		froze := strings.Contains(e.Log()[logFrom:], "froze the task for a snapshot in the shim")
		if froze != inShim {
			t.Errorf("intent %v: the shim's log says it froze the task itself: %v", inShim, froze)
		}
		status(containerd.Paused)
		if !frozen() {
			t.Fatal("the task says it is paused; its cgroup is not frozen")
		}
		nextEvent("/tasks/paused")
		n := c.lastTick(t)
		time.Sleep(300 * time.Millisecond)
		if m := c.lastTick(t); m != n {
			t.Errorf("paused, the counter went on from tick %d to %d", n, m)
		}
		if err := c.task.Pause(ctx); err == nil {
			t.Error("a second Pause of a paused task succeeded")
		}
		// An exec would join the frozen cgroup (and the snapshot's dump).
		if p, err := c.task.Exec(ctx, "probe-"+lfRandom(3), &specs.Process{Args: []string{"true"}, Cwd: "/"}, cio.NullIO); err == nil {
			p.Delete(ctx, containerd.WithProcessKill)
			t.Error("an exec into the paused task was made")
		}
		if err := c.task.Resume(ctx); err != nil {
			t.Fatal(err)
		}
		status(containerd.Running)
		if frozen() {
			t.Fatal("resumed, the task's cgroup is still frozen")
		}
		nextEvent("/tasks/resumed")
		c.waitLine(t, ctx, len(c.lines(t)), fmt.Sprintf("tick %d", n+2))
	}
	pauseResume(true)
	pauseResume(false) // runc's pause, unchanged
	pauseResume(true)

	// Killed while the shim holds it frozen: runc sees a paused container
	// and thaws it for SIGKILL.
	intent()
	if err := c.task.Pause(ctx); err != nil {
		t.Fatal(err)
	}
	exited, err := c.task.Wait(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if err := c.task.Kill(ctx, syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	select {
	case st := <-exited:
		if code := st.ExitCode(); code != 128+uint32(syscall.SIGKILL) {
			t.Errorf("exit status %d, want %d", code, 128+syscall.SIGKILL)
		}
	case <-time.After(30 * time.Second):
		t.Fatal("killed while frozen in the shim, the task does not end")
	}
}
