package integration

import (
	"context"
	"fmt"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/containerd/containerd/api/types/runc/options"
	"github.com/containerd/containerd/v2/client"

	"github.com/lazyfork/lazyfork/integration/harness"
	"github.com/lazyfork/lazyfork/integration/workloads"
	"github.com/lazyfork/lazyfork/internal/testutil"
)

// heapMiB is the counter's heap in the checkpoint tests and the baseline benchmark.
const heapMiB = 256

// TestCheckpointRestoreCopy is the plain-runc baseline that LazyFork must beat,
// checked for correctness: a python container holding a 256 MiB heap and counting
// is checkpointed (leave running) to an image directory through the containerd Go
// client, and restored as a second container with its own cgroups path. Both must
// keep counting from where they were, the copy's heap must be intact, and a write
// in the copy must not show in the parent.
func TestCheckpointRestoreCopy(t *testing.T) {
	testutil.RequiresCRIU(t)
	testutil.RequiresBinary(t, "containerd")
	testutil.RequiresBinary(t, "runc")
	h := harness.StartT(t, harness.Options{})
	ctx, cancel := context.WithTimeout(h.Context(t.Context()), 8*time.Minute)
	defer cancel()

	img, err := h.ImportImage(ctx, "python")
	if err != nil {
		t.Fatal(err)
	}
	parent, err := h.NewContainer(ctx, "parent", harness.ContainerConfig{Image: img, Args: workloads.CounterArgs(heapMiB)})
	if err != nil {
		t.Fatal(err)
	}
	ptask, err := h.StartTask(ctx, parent)
	if err != nil {
		t.Fatal(err)
	}
	plog := h.TaskLogPath("parent")
	if _, err := workloads.WaitReady(ctx, plog); err != nil {
		t.Fatal(err)
	}
	if _, err := workloads.WaitTickAbove(ctx, plog, 2); err != nil {
		t.Fatal(err)
	}

	imageDir, err := h.TempDir("ckpt-")
	if err != nil {
		t.Fatal(err)
	}
	before, err := workloads.LastTick(plog)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := ptask.Checkpoint(ctx, withCheckpointOptions(&options.CheckpointOptions{Exit: false, ImagePath: imageDir})); err != nil {
		t.Fatalf("checkpoint: %v", err)
	}
	after, err := workloads.LastTick(plog)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(imageDir + "/inventory.img"); err != nil {
		t.Fatalf("checkpoint wrote no CRIU image: %v", err)
	}
	st, err := ptask.Status(ctx)
	if err != nil || st.Status != client.Running {
		t.Fatalf("parent after checkpoint: %v (%v), want running", st.Status, err)
	}
	if _, err := workloads.WaitTickAbove(ctx, plog, after); err != nil {
		t.Fatalf("parent stopped counting after the checkpoint: %v", err)
	}

	cp, err := h.CloneContainer(ctx, parent, "copy")
	if err != nil {
		t.Fatal(err)
	}
	ctask, err := h.StartTask(ctx, cp, client.WithRestoreImagePath(imageDir))
	if err != nil {
		t.Fatalf("restore: %v", err)
	}
	clog := h.TaskLogPath("copy")
	first, err := workloads.FirstTick(ctx, clog)
	if err != nil {
		t.Fatal(err)
	}
	// The dump froze the counter somewhere between the last tick printed before
	// the checkpoint call and the last one printed when it returned.
	if first <= before || first > after+1 {
		t.Fatalf("copy's first tick %d, want in (%d, %d]: it did not continue from the checkpoint", first, before, after+1)
	}
	if lines, _ := harness.ReadLines(clog); len(lines) > 0 && workloads.IsReady(lines[0]) {
		t.Fatalf("copy started afresh: %q", lines[0])
	}
	if _, err := workloads.WaitTickAbove(ctx, clog, first); err != nil {
		t.Fatalf("copy does not keep counting: %v", err)
	}

	// Own cgroup, own process.
	cpid := ctask.Pid()
	cg, err := os.ReadFile(fmt.Sprintf("/proc/%d/cgroup", cpid))
	if err != nil || !strings.Contains(string(cg), h.CgroupPath("copy")) {
		t.Fatalf("copy pid %d cgroups %q (%v), want under %s", cpid, cg, err, h.CgroupPath("copy"))
	}
	if cpid == ptask.Pid() {
		t.Fatalf("copy and parent share pid %d", cpid)
	}

	// The copy's heap is intact; a write in the copy stays in the copy.
	if line, err := workloads.Verify(ctx, ctask, clog); err != nil {
		t.Fatalf("copy heap: %v", err)
	} else if !strings.Contains(line, fmt.Sprintf("pages=%d writes=0", heapMiB*256)) {
		t.Fatalf("copy verify: %q", line)
	}
	if _, err := workloads.Write(ctx, ctask, clog); err != nil {
		t.Fatal(err)
	}
	if line, err := workloads.Verify(ctx, ctask, clog); err != nil || !strings.Contains(line, "writes=1") {
		t.Fatalf("copy verify after its write: %q %v", line, err)
	}
	if line, err := workloads.Verify(ctx, ptask, plog); err != nil || !strings.Contains(line, "writes=0") {
		t.Fatalf("parent verify after the copy's write: %q %v", line, err)
	}
	pt, _ := workloads.LastTick(plog)
	ct, _ := workloads.LastTick(clog)
	t.Logf("checkpoint between ticks %d and %d; copy resumed at %d; now parent %d, copy %d", before, after, first, pt, ct)
}

// withCheckpointOptions passes runc's checkpoint options as they are.
func withCheckpointOptions(o *options.CheckpointOptions) client.CheckpointTaskOpts {
	return func(r *client.CheckpointTaskInfo) error {
		r.Options = o
		return nil
	}
}
