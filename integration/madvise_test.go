package integration

import (
	"strings"
	"testing"

	"github.com/containerd/containerd/api/types/runc/options"
	containerd "github.com/containerd/containerd/v2/client"
	"github.com/containerd/containerd/v2/pkg/oci"

	"github.com/lazyfork/lazyfork/integration/harness"
	"github.com/lazyfork/lazyfork/integration/workloads"
	"github.com/lazyfork/lazyfork/memfile"
	"github.com/lazyfork/lazyfork/memfile/madvguard"
)

// TestShimMadviseGuard: every checkpoint the shim takes carries the madvise
// guard (refuse) on the ranges that hold data unless the container says
// lazyfork.io/madvise=off; a bad mode is refused at create. A fork restored
// from a guarded snapshot keeps counting.
func TestShimMadviseGuard(t *testing.T) {
	e, ctx, img := startLFPython(t)
	checkpoint := func(id string, annot map[string]string) (containerd.Container, string) {
		t.Helper()
		ctr, task := e.run(t, ctx, img, id, workloads.CounterArgs(16), oci.WithAnnotations(annot))
		if _, err := workloads.WaitTickAbove(ctx, e.TaskLogPath(id), 1); err != nil {
			t.Fatal(err)
		}
		dir, err := e.TempDir("mg-")
		if err != nil {
			t.Fatal(err)
		}
		if _, err := task.Checkpoint(ctx, withCheckpointOptions(&options.CheckpointOptions{ImagePath: dir})); err != nil {
			t.Fatalf("checkpoint %s: %v", id, err)
		}
		if _, err := memfile.ReadSnapshot(dir); err != nil {
			t.Fatalf("%s: not a LazyFork snapshot: %v", id, err)
		}
		return ctr, dir
	}

	parent, def := checkpoint("mg-def-"+lfRandom(3), nil)
	if ok, err := madvguard.Installed(def); err != nil || !ok {
		t.Fatalf("default checkpoint: guard installed=%v (%v), want true", ok, err)
	}
	ths, err := madvguard.Inspect(def)
	if err != nil {
		t.Fatal(err)
	}
	for _, th := range ths {
		if th.Guards != 1 || th.Mode != madvguard.Refuse || len(th.Ranges) == 0 {
			t.Errorf("thread %d/%d: guards=%d mode=%s ranges=%v, want one refuse guard with ranges", th.Pid, th.Tid, th.Guards, th.Mode, th.Ranges)
		}
	}

	_, zero := checkpoint("mg-zero-"+lfRandom(3), map[string]string{"lazyfork.io/madvise": "zero"})
	if ths, err := madvguard.Inspect(zero); err != nil || len(ths) == 0 || ths[0].Mode != madvguard.Zero {
		t.Errorf("zero checkpoint: %+v (%v), want zero-mode guard", ths, err)
	}

	_, off := checkpoint("mg-off-"+lfRandom(3), map[string]string{"lazyfork.io/madvise": "off"})
	if ok, err := madvguard.Installed(off); err != nil || ok {
		t.Errorf("madvise=off checkpoint: guard installed=%v (%v), want false", ok, err)
	}

	// A bad mode is a clear create error.
	bad := "mg-bad-" + lfRandom(3)
	ctr, err := e.NewContainer(ctx, bad, harness.ContainerConfig{Image: img, Args: []string{"sleep", "1000"}, Runtime: lfRuntime,
		SpecOpts: []oci.SpecOpts{oci.WithAnnotations(map[string]string{"lazyfork.io/madvise": "bogus"})}})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := e.NewTask(ctx, ctr); err == nil || !strings.Contains(err.Error(), "lazyfork.io/madvise") {
		t.Fatalf("create with madvise=bogus: %v, want an error naming the annotation", err)
	}

	// A fork restored from the guarded snapshot continues counting (python's
	// allocator ignores refused purges).
	fid := "mg-fork-" + lfRandom(3)
	fork, err := e.CloneContainer(ctx, parent, fid)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := e.StartTask(ctx, fork, containerd.WithRestoreImagePath(def)); err != nil {
		t.Fatalf("restore from guarded snapshot: %v", err)
	}
	first, err := workloads.FirstTick(ctx, e.TaskLogPath(fid))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := workloads.WaitTickAbove(ctx, e.TaskLogPath(fid), first+1); err != nil {
		t.Fatalf("fork of a guarded snapshot stopped counting: %v", err)
	}
}
