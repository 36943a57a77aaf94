package integration

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/lazyfork/lazyfork/api"
	lfclient "github.com/lazyfork/lazyfork/client"
	"github.com/lazyfork/lazyfork/integration/harness"
	"github.com/lazyfork/lazyfork/memfile"
	"github.com/lazyfork/lazyfork/node"
)

// TestPodSnapshotOrphan: lazyfork-snapshotter dies (killed at a failpoint)
// after the node API's SnapshotForPod made a pod fork's snapshot of a running
// container and before the fork's shim got it, so no container will ever own
// it. The snapshot and its reference on the family's memory files are then
// lazyfork gc's: once older than OrphanAge, gc removes both. The parent runs on.
func TestPodSnapshotOrphan(t *testing.T) {
	na := newNodeAPI(t)
	e := startLF(t, harness.Options{Env: []string{na.Env()}})
	ctx := e.ctx(t)
	img, err := e.ImportImage(ctx, "python")
	if err != nil {
		t.Fatal(err)
	}
	id := "orph-" + lfRandom(4)
	_, task := e.run(t, ctx, img, id, []string{"sh", "-c", "echo parent > /a && echo ready && exec sleep 100000"})
	if _, err := harness.WaitLine(ctx, e.TaskLogPath(id), 0, func(l string) bool { return l == "ready" }); err != nil {
		t.Fatal(err)
	}

	t.Setenv("LAZYFORK_FAILPOINT", lfclient.FailPodSnapshotMade+":exit")
	na.start(t, e.Bin, e.Root)
	os.Unsetenv("LAZYFORK_FAILPOINT")
	r := node.NewRemote(na.socket)
	defer r.Close()
	_, err = r.SnapshotForPod(ctx, node.PodSnapshot{
		ForkOfContext: node.ForkOfContext{Containerd: e.Address, Namespace: e.Namespace, Root: e.Root},
		Ref:           id, Upper: t.TempDir(),
	})
	if err == nil {
		t.Fatal("SnapshotForPod succeeded: the snapshotter did not die at the failpoint")
	}
	if b, _ := os.ReadFile(filepath.Join(na.dir, "snapshotter.log")); !strings.Contains(string(b), "failpoint "+lfclient.FailPodSnapshotMade) {
		t.Fatalf("SnapshotForPod: %v, and the snapshotter did not reach the failpoint:\n%s", err, b)
	}

	snapshots := api.Root(e.Root).Snapshots()
	dirs := dirNames(t, snapshots)
	if len(dirs) != 1 {
		t.Fatalf("snapshot directories after the snapshotter died: %v, want the one it made", dirs)
	}
	orphan := filepath.Join(snapshots, dirs[0])
	snap, err := memfile.ReadSnapshot(api.ImageDir(orphan))
	if err != nil {
		t.Fatalf("the snapshot left behind: %v", err)
	}
	holder := memfile.HolderSnapshot + api.ImageDir(orphan)
	holds := func() bool {
		fams, err := node.NewLocal(e.Root).Families(ctx)
		if err != nil {
			t.Fatal(err)
		}
		for _, f := range fams {
			if _, ok := f.Holders[holder]; ok && f.Name == snap.Family {
				return true
			}
		}
		return false
	}
	if !holds() {
		t.Fatalf("the snapshot left behind holds no files of family %s", snap.Family)
	}

	// A fresh orphan stays (its owner may be about to claim it)...
	lf := e.lfClient()
	if _, err := lf.GC(ctx, false); err != nil {
		t.Fatalf("lazyfork gc: %v", err)
	}
	if _, err := os.Stat(orphan); err != nil {
		t.Fatalf("gc removed a snapshot younger than OrphanAge: %v", err)
	}
	// ...one older than OrphanAge goes, with its reference.
	old := time.Now().Add(-2 * lfclient.OrphanAge)
	if err := os.Chtimes(orphan, old, old); err != nil {
		t.Fatal(err)
	}
	rep, err := lf.GC(ctx, false)
	if err != nil {
		t.Fatalf("lazyfork gc: %v", err)
	}
	t.Logf("gc: %v", rep.Removed)
	if _, err := os.Stat(orphan); err == nil {
		t.Errorf("lazyfork gc left the unowned snapshot %s", orphan)
	}
	if holds() {
		t.Errorf("family %s still held by %s after gc", snap.Family, holder)
	}
	if out := strings.TrimSpace(e.sh(t, ctx, task, "cat /a")); out != "parent" {
		t.Errorf("the parent after all this: /a %q", out)
	}
}
