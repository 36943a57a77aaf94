//go:build linux

package client_test

import (
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"testing"
	"time"

	containerd "github.com/containerd/containerd/v2/client"
	"github.com/containerd/containerd/v2/core/snapshots"
	"github.com/containerd/containerd/v2/pkg/cio"

	"github.com/lazyfork/lazyfork/client"
	"github.com/lazyfork/lazyfork/integration/harness"
	"github.com/lazyfork/lazyfork/internal/testutil"
)

// TestForksShareOneBatchLayer: on a snapshotter without frozen layers
// (overlayfs), the forks of one call stack their rootfs on one layer holding
// the parent's writable layer instead of each copying it; they see the
// parent's files and their writes stay their own; and a fork's snapshot
// records everything above the image (that layer and the fork's own writes),
// so a fork of the fork, and a rootfs prepared elsewhere (SnapshotForRootfs),
// see what the fork saw.
func TestForksShareOneBatchLayer(t *testing.T) {
	testutil.Integration(t)
	testutil.RequiresRoot(t)
	testutil.RequiresCRIU(t)
	testutil.RequiresBinary(t, "containerd")
	bin := os.Getenv("LAZYFORK_BIN")
	if bin == "" {
		dir := t.TempDir()
		repo, err := harness.RepoRoot()
		if err != nil {
			t.Fatal(err)
		}
		cmd := exec.Command("go", "build", "-o", dir+"/", "./cmd/containerd-shim-lazyfork-v1", "./cmd/containerd-shim-lazyfork-v1-full")
		cmd.Dir = repo
		if out, err := cmd.CombinedOutput(); err != nil {
			t.Fatalf("build the shim: %v\n%s", err, out)
		}
		bin = dir
	}
	root, err := os.MkdirTemp("/tmp", "lfr-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := harness.RemoveLazyForkRoot(root); err != nil {
			t.Errorf("remove LazyFork root %s: %v", root, err)
		}
	})
	h := harness.StartT(t, harness.Options{BinDirs: []string{bin}, Env: []string{"LAZYFORK_ROOT=" + root}})
	ctx, cancel := context.WithTimeout(h.Context(context.Background()), 5*time.Minute)
	defer cancel()
	img, err := h.ImportImage(ctx, "busybox")
	if err != nil {
		t.Fatal(err)
	}
	lf := client.New(h.Client(), client.WithRoot(root))
	var made []containerd.Container
	t.Cleanup(func() {
		ctx := h.Context(context.Background())
		for _, c := range made {
			if task, err := c.Task(ctx, nil); err == nil {
				_, _ = task.Delete(ctx, containerd.WithProcessKill)
			}
			_ = c.Delete(ctx, containerd.WithSnapshotCleanup)
		}
	})
	ctr, err := h.NewContainer(ctx, "batch-parent", harness.ContainerConfig{
		Image: img, Runtime: "io.containerd.lazyfork.v1",
		Args: []string{"sh", "-c", "echo from-parent > /marker && echo x > /gone && touch /ready && exec sleep 1000"},
	})
	if err != nil {
		t.Fatal(err)
	}
	made = append(made, ctr)
	if _, err := h.StartTask(ctx, ctr); err != nil {
		t.Fatal(err)
	}
	rootfs := func(id string) string {
		return filepath.Join(h.State, "io.containerd.runtime.v2.task", h.Namespace, id, "rootfs")
	}
	for deadline := time.Now().Add(30 * time.Second); ; time.Sleep(50 * time.Millisecond) {
		if _, err := os.Stat(filepath.Join(rootfs(ctr.ID()), "ready")); err == nil {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("the parent did not write its files")
		}
	}
	discard := client.WithIO(func(string) cio.Creator { return cio.LogFile("/dev/null") })
	sn := h.Client().SnapshotService("overlayfs")
	batchLayers := func() []string {
		t.Helper()
		var names []string
		if err := sn.Walk(ctx, func(_ context.Context, i snapshots.Info) error {
			names = append(names, i.Name)
			return nil
		}, `labels."lazyfork.io/batch-layer"`); err != nil {
			t.Fatal(err)
		}
		return names
	}
	// A call whose forks all fail leaves no layer behind.
	if _, err := lf.Fork(ctx, ctr.ID(), 2, discard, client.WithTimeout(time.Nanosecond)); err != nil {
		t.Logf("failed as it should: %v", err)
	} else {
		t.Fatal("forks restored within a nanosecond")
	}
	if l := batchLayers(); len(l) > 0 {
		t.Errorf("a failed call left its batch layer: %v", l)
	}
	res, err := lf.Fork(ctx, ctr.ID(), 3, discard)
	if err != nil {
		t.Fatal(err)
	}
	for _, f := range res.Forks {
		made = append(made, f.Container)
	}
	var base string
	for _, f := range res.Forks {
		info, err := sn.Stat(ctx, f.Container.ID())
		if err != nil {
			t.Fatal(err)
		}
		if base == "" {
			base = info.Parent
		}
		if info.Parent != base {
			t.Errorf("fork %s stacks on %q, fork %s on %q: want one layer for the call", f.Container.ID(), info.Parent, res.Forks[0].Container.ID(), base)
		}
		if b, err := os.ReadFile(filepath.Join(rootfs(f.Container.ID()), "marker")); err != nil || string(b) != "from-parent\n" {
			t.Errorf("fork %s: /marker %q (%v), want the parent's", f.Container.ID(), b, err)
		}
	}
	if bi, err := sn.Stat(ctx, base); err != nil || bi.Labels["lazyfork.io/batch-layer"] == "" {
		t.Errorf("the forks' base %q (%v) is not a batch layer (labels %v): each fork has its own copy", base, err, bi.Labels)
	}

	// A kept snapshot restored again: the later call's forks stack on the
	// layer its first call made, not on a copy of their own.
	kept, err := lf.Fork(ctx, ctr.ID(), 1, discard, client.KeepSnapshot())
	if err != nil {
		t.Fatal(err)
	}
	defer lf.RemoveSnapshot(context.WithoutCancel(ctx), kept.Snapshot)
	made = append(made, kept.Forks[0].Container)
	keptInfo, err := sn.Stat(ctx, kept.Forks[0].Container.ID())
	if err != nil {
		t.Fatal(err)
	}
	again, err := lf.RestoreForks(ctx, ctr.ID(), kept.Snapshot, 2, discard)
	if err != nil {
		t.Fatal(err)
	}
	for _, f := range again {
		made = append(made, f.Container)
		info, err := sn.Stat(ctx, f.Container.ID())
		if err != nil {
			t.Fatal(err)
		}
		if info.Parent != keptInfo.Parent {
			t.Errorf("fork %s of the snapshot restored again stacks on %q, the snapshot's first fork on %q: want its layer shared", f.Container.ID(), info.Parent, keptInfo.Parent)
		}
		if b, err := os.ReadFile(filepath.Join(rootfs(f.Container.ID()), "marker")); err != nil || string(b) != "from-parent\n" {
			t.Errorf("fork %s of the snapshot restored again: /marker %q (%v), want the parent's", f.Container.ID(), b, err)
		}
	}

	// One fork deletes a file of its parent and writes its own.
	f1 := res.Forks[0].Container.ID()
	if err := os.Remove(filepath.Join(rootfs(f1), "gone")); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(rootfs(f1), "mine"), []byte("from-fork\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(filepath.Join(rootfs(res.Forks[1].Container.ID()), "mine")); err == nil {
		t.Errorf("a fork's write reached its sibling")
	}
	check := func(what, dir string, layer bool) {
		t.Helper()
		if b, err := os.ReadFile(filepath.Join(dir, "marker")); err != nil || string(b) != "from-parent\n" {
			t.Errorf("%s: /marker %q (%v), want the parent's", what, b, err)
		}
		if b, err := os.ReadFile(filepath.Join(dir, "mine")); err != nil || string(b) != "from-fork\n" {
			t.Errorf("%s: /mine %q (%v), want the fork's", what, b, err)
		}
		// Deleted by the fork: absent, or, in a layer, absent or a whiteout.
		if fi, err := os.Lstat(filepath.Join(dir, "gone")); err == nil && (!layer || fi.Mode()&os.ModeCharDevice == 0) {
			t.Errorf("%s: /gone, deleted by the fork, is back", what)
		}
	}
	// Its fork sees what it saw.
	res2, err := lf.Fork(ctx, f1, 1, discard)
	if err != nil {
		t.Fatal(err)
	}
	made = append(made, res2.Forks[0].Container)
	check("fork of a fork", rootfs(res2.Forks[0].Container.ID()), false)
	// So does a rootfs prepared elsewhere, given the snapshot's layer.
	upper := t.TempDir()
	image, err := lf.SnapshotForRootfs(ctx, f1, upper)
	if err != nil {
		t.Fatal(err)
	}
	defer lf.RemoveSnapshot(context.WithoutCancel(ctx), image)
	check("the layer SnapshotForRootfs copies", upper, true)

	// The layer lives as long as a fork stacks on it.
	for _, c := range append(made[1:], nil) {
		if c == nil {
			break
		}
		if task, err := c.Task(ctx, nil); err == nil {
			if _, err := task.Delete(ctx, containerd.WithProcessKill); err != nil {
				t.Fatal(err)
			}
		}
		if err := c.Delete(ctx, containerd.WithSnapshotCleanup); err != nil {
			t.Fatal(err)
		}
	}
	made = made[:1]
	// Waiting for the layer to go: a synchronous collection now and then
	// (harness.CollectGarbage says why). A layer something still
	// references survives it.
	for deadline, next := time.Now().Add(time.Minute), time.Now(); len(batchLayers()) > 0; time.Sleep(100 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("the forks are gone, their batch layers are not: %v", batchLayers())
		}
		if time.Now().After(next) {
			if err := h.CollectGarbage(ctx); err != nil {
				t.Fatal(err)
			}
			next = time.Now().Add(5 * time.Second)
		}
	}
}
