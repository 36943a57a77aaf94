package integration

import (
	"context"
	"strings"
	"testing"
	"time"

	tasksapi "github.com/containerd/containerd/api/services/tasks/v1"
	containerd "github.com/containerd/containerd/v2/client"
	"github.com/containerd/containerd/v2/pkg/oci"
	"github.com/opencontainers/runtime-spec/specs-go"

	"github.com/lazyfork/lazyfork/integration/harness"
)

// lastPurges returns the fields of the last complete "purges" line of a
// purgeloop task log.
func lastPurges(t *testing.T, path string) map[string]string {
	t.Helper()
	lines, err := harness.ReadLines(path)
	if err != nil {
		t.Fatal(err)
	}
	for i := len(lines) - 1; i >= 0; i-- {
		f := strings.Fields(lines[i])
		if len(f) == 6 && f[0] == "purges" {
			kv := map[string]string{"line": lines[i]}
			for _, x := range f[1:] {
				k, v, _ := strings.Cut(x, "=")
				kv[k] = v
			}
			return kv
		}
	}
	t.Fatalf("no purges line in %s", path)
	return nil
}

// startPurgeloop runs the purgeloop program in a zero-mode LazyFork container.
func startPurgeloop(t *testing.T, e *lfEnv, ctx context.Context, prefix string) string {
	t.Helper()
	bin := staticProgram(t, "memfile/madvguard/testdata/purgeloop.c")
	img, err := e.ImportImage(ctx, "busybox")
	if err != nil {
		t.Fatal(err)
	}
	id := prefix + lfRandom(3)
	e.run(t, ctx, img, id, []string{"/purgeloop"},
		oci.WithMounts([]specs.Mount{{Destination: "/purgeloop", Type: "bind", Source: bin, Options: []string{"rbind", "ro"}}}),
		oci.WithAnnotations(map[string]string{"lazyfork.io/madvise": "zero"}))
	return id
}

// waitPurges waits until container id's purgeloop has made more purges, and
// returns its last purges line's fields.
func waitPurges(t *testing.T, e *lfEnv, ctx context.Context, id string, more uint64) map[string]string {
	t.Helper()
	path := e.TaskLogPath(id)
	wctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	if _, err := harness.WaitLine(wctx, path, 0, func(l string) bool { return strings.HasPrefix(l, "purges ") }); err != nil {
		t.Fatalf("%s: no purges line: %v", id, err)
	}
	start := lastPurges(t, path)
	for {
		kv := lastPurges(t, path)
		if len(kv["n"]) > 0 && kv["n"] != start["n"] && atoi(kv["n"]) >= atoi(start["n"])+more {
			return kv
		}
		select {
		case <-wctx.Done():
			t.Fatalf("%s: purges stopped at %s", id, kv["line"])
		case <-time.After(20 * time.Millisecond):
		}
	}
}

// TestZeroModeExact: with lazyfork.io/madvise=zero, a program that purges
// its memory all the time (memfile/madvguard/testdata/purgeloop.c) never
// sees a purge fail, in a fork, a second fork, and a fork of a fork: not
// the first purge after a restore (the supervisor attaches while the
// restored task is still frozen), nor the first after the fork is itself
// paused and snapshotted (held, frozen, detached; attached again before
// the thaw). Before, each restore and each snapshot of a fork let one or
// more purges fail with ENOSYS.
func TestZeroModeExact(t *testing.T) {
	e := startLF(t, harness.Options{})
	ctx := e.ctx(t)
	id := startPurgeloop(t, e, ctx, "zx-")
	lf := e.lfClient()
	waitPurges := func(id string, more uint64) map[string]string {
		t.Helper()
		return waitPurges(t, e, ctx, id, more)
	}
	fork := func(id string) (string, containerd.Task) {
		t.Helper()
		fctx, cancel := context.WithTimeout(ctx, 2*time.Minute)
		defer cancel()
		res, err := lf.Fork(fctx, id, 1, e.logIO())
		if err != nil {
			t.Fatalf("fork %s: %v", id, err)
		}
		return res.Forks[0].Container.ID(), res.Forks[0].Task
	}
	waitPurges(id, 1000)
	procs := []string{id}
	child, ctask := fork(id)
	procs = append(procs, child)
	for i := 0; i < 2; i++ {
		c, _ := fork(id)
		procs = append(procs, c)
	}
	waitPurges(child, 2000)
	if tracer(t, ctask.Pid()) == 0 {
		t.Fatalf("fork %s has no madvise supervisor", child)
	}
	for i := 0; i < 3; i++ {
		g, _ := fork(child) // the child is paused, snapshotted, resumed
		procs = append(procs, g)
		waitPurges(child, 2000)
	}
	for _, c := range procs {
		kv := waitPurges(c, 2000)
		if kv["bad"] != "0" || kv["stale"] != "0" {
			t.Errorf("%s: %s; want bad=0 stale=0 (every purge returns 0 and reads zeros)", c, kv["line"])
		} else {
			t.Logf("%s: %s", c, kv["line"])
		}
	}
}

// TestZeroModeExactUnpausedCheckpoint: checkpoints of a running zero-mode
// task serve every purge: containerd's client (ctr, CRI's checkpoint) pauses
// the task first; a bare task-service Checkpoint does not, and the shim then
// holds and freezes the supervised task for its dump as Pause does. Before,
// the task ran unsupervised from the supervisor letting go until CRIU froze
// it, and from CRIU's thaw until the supervisor was back, and purges in those
// windows failed with ENOSYS.
func TestZeroModeExactUnpausedCheckpoint(t *testing.T) {
	e := startLF(t, harness.Options{})
	ctx := e.ctx(t)
	id := startPurgeloop(t, e, ctx, "zc-")
	res, err := e.lfClient().Fork(ctx, id, 1, e.logIO())
	if err != nil {
		t.Fatalf("fork %s: %v", id, err)
	}
	child, task := res.Forks[0].Container.ID(), res.Forks[0].Task
	waitN := func(more uint64) map[string]string {
		t.Helper()
		return waitPurges(t, e, ctx, child, more)
	}
	waitN(2000)
	if tracer(t, task.Pid()) == 0 {
		t.Fatalf("fork %s has no madvise supervisor", child)
	}
	for i := 0; i < 5; i++ {
		if i%2 == 0 {
			if _, err := e.Client().TaskService().Checkpoint(ctx, &tasksapi.CheckpointTaskRequest{ContainerID: child}); err != nil {
				t.Fatalf("task-service checkpoint %d of %s (running, not paused): %v", i, child, err)
			}
		} else {
			time.Sleep(1100 * time.Millisecond) // containerd names its checkpoint image by the second
			if _, err := task.Checkpoint(ctx, containerd.WithCheckpointImagePath(t.TempDir())); err != nil {
				t.Fatalf("client checkpoint %d of %s: %v", i, child, err)
			}
		}
		waitN(2000)
		if st, err := task.Status(ctx); err != nil || st.Status != containerd.Running {
			t.Fatalf("after checkpoint %d: %s is %v (%v), want running", i, child, st.Status, err)
		}
		if tracer(t, task.Pid()) == 0 {
			t.Fatalf("after checkpoint %d: %s has no madvise supervisor", i, child)
		}
	}
	if kv := waitN(2000); kv["bad"] != "0" || kv["stale"] != "0" {
		t.Errorf("%s after 5 unpaused checkpoints: %s; want bad=0 stale=0", child, kv["line"])
	} else {
		t.Logf("%s: %s", child, kv["line"])
	}
}

func atoi(s string) uint64 {
	var n uint64
	for _, c := range s {
		if c < '0' || c > '9' {
			return n
		}
		n = n*10 + uint64(c-'0')
	}
	return n
}
