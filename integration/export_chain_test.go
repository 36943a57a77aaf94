package integration

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"

	containerd "github.com/containerd/containerd/v2/client"
	"github.com/containerd/containerd/v2/core/mount"
	"github.com/containerd/containerd/v2/pkg/archive"
	"github.com/containerd/containerd/v2/pkg/archive/compression"
	specs "github.com/opencontainers/runtime-spec/specs-go"

	"github.com/lazyfork/lazyfork/integration/harness"
	"github.com/lazyfork/lazyfork/internal/testutil"
	snapclient "github.com/lazyfork/lazyfork/snapshotter/client"
)

// chainFiles is what a restored copy of the second fork must see: the
// parent's file, the first fork's, its own, and not the file the first fork
// removed.
const chainFiles = "a=parent-a b=fork1-b c=fork2-c d=gone"

// catChain prints the chain's files as chainFiles spells them.
const catChain = `for f in a b c d; do if [ -e /$f ]; then printf '%s=%s ' $f "$(cat /$f)"; else printf '%s=gone ' $f; fi; done`

// TestExportForkOfFork: a container writes /a (and /d), is forked; the fork
// writes /b and removes /d and is forked in turn; that fork writes /c. Its
// export (of the running container, and of a snapshot kept of it) carries
// the whole writable layer of the chain: restored elsewhere, by plain runc
// from the archive (rootfs-diff.tar applied first, as the docs say) and by
// `lazyfork import` and a fork, it sees /a, /b and /c with their contents and
// no /d. On containerd's overlayfs (forks on batch layers) and on LazyFork's
// snapshotter (forks on frozen layers stacked on frozen layers).
func TestExportForkOfFork(t *testing.T) {
	testutil.RequiresBinary(t, "runc")
	for _, sn := range []string{"overlayfs", snapclient.SnapshotterName} {
		t.Run(sn, func(t *testing.T) {
			var e *lfEnv
			if sn == snapclient.SnapshotterName {
				testutil.RequiresRoot(t)
				bin := lfBin(t)
				snRoot, snAddr := startSnapshotter(t, bin)
				t.Setenv("LAZYFORK_BIN", bin)
				e = startLF(t, harness.Options{ProxyPlugins: []harness.ProxyPlugin{{
					Name: sn, Type: "snapshot", Address: snAddr, ExportsRoot: snRoot,
				}}})
			} else {
				e = startLF(t, harness.Options{})
			}
			ctx := e.ctx(t)
			img, err := e.ImportImage(ctx, "python", harness.WithSnapshotter(sn))
			if err != nil {
				t.Fatal(err)
			}
			exportForkOfFork(t, ctx, e, img, sn)
		})
	}
}

func exportForkOfFork(t *testing.T, ctx context.Context, e *lfEnv, img containerd.Image, sn string) {
	lf := e.lfClient()
	id := "chain-" + lfRandom(4)
	ctr, err := e.NewContainer(ctx, id, harness.ContainerConfig{
		Image: img, Runtime: lfRuntime, Snapshotter: sn,
		Args: []string{"sh", "-c", "echo parent-a > /a && echo parent-d > /d && echo ready && exec sleep 100000"},
	})
	if err != nil {
		t.Fatal(err)
	}
	task, err := e.StartTask(ctx, ctr)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := harness.WaitLine(ctx, e.TaskLogPath(id), 0, func(l string) bool { return l == "ready" }); err != nil {
		t.Fatal(err)
	}

	res1, err := lf.Fork(ctx, id, 1, e.logIO())
	if err != nil {
		t.Fatalf("fork the parent: %v", err)
	}
	fork1 := res1.Forks[0]
	e.sh(t, ctx, fork1.Task, "echo fork1-b > /b && rm /d")
	res2, err := lf.Fork(ctx, fork1.Container.ID(), 1, e.logIO())
	if err != nil {
		t.Fatalf("fork the fork: %v", err)
	}
	fork2 := res2.Forks[0]
	e.sh(t, ctx, fork2.Task, "echo fork2-c > /c")
	if got := strings.TrimSpace(e.sh(t, ctx, fork2.Task, catChain)); got != chainFiles {
		t.Fatalf("the second fork sees %q, want %q", got, chainFiles)
	}
	// What the parent and the first fork wrote later is no part of it.
	e.sh(t, ctx, task, "echo parent-late > /a")
	e.sh(t, ctx, fork1.Task, "echo fork1-late > /b")

	dir := t.TempDir()
	running := filepath.Join(dir, "running.tar")
	if _, err := e.lfCLI(t, "export", fork2.Container.ID(), "-o", running); err != nil {
		t.Fatalf("lazyfork export of the fork of a fork: %v", err)
	}
	kept, err := lf.Checkpoint(ctx, fork2.Container.ID())
	if err != nil {
		t.Fatal(err)
	}
	ofSnap := filepath.Join(dir, "snapshot.tar")
	if _, err := e.lfCLI(t, "export", kept.Snapshot, "-o", ofSnap); err != nil {
		t.Fatalf("lazyfork export of a snapshot of the fork of a fork: %v", err)
	}

	for i, archivePath := range []string{running, ofSnap} {
		name := strings.TrimSuffix(filepath.Base(archivePath), ".tar")
		plainID := "plain-" + name
		plain := plainRestore(t, ctx, e, img, sn, archivePath, plainID)
		if got := strings.TrimSpace(e.sh(t, ctx, plain, catChain)); got != chainFiles {
			t.Errorf("plain runc restore of the %s export sees %q, want %q", name, got, chainFiles)
		}
		if i > 0 {
			continue
		}
		imp := "imp-" + name
		if _, err := e.lfCLI(t, "import", archivePath, "--name", imp, "--cgroup-parent", e.CgroupParent); err != nil {
			t.Fatalf("lazyfork import of the %s export: %v", name, err)
		}
		res, err := lf.Fork(ctx, imp, 1, e.logIO())
		if err != nil {
			t.Fatalf("fork the imported %s export: %v", name, err)
		}
		if got := strings.TrimSpace(e.sh(t, ctx, res.Forks[0].Task, catChain)); got != chainFiles {
			t.Errorf("a fork of the imported %s export sees %q, want %q", name, got, chainFiles)
		}
	}
	// A pod's fork-of the kept snapshot gets the same layer in its upper
	// directory (a whiteout where /d was).
	upper := t.TempDir()
	if err := lf.CopySnapshotLayer(ctx, kept.Snapshot, upper); err != nil {
		t.Fatalf("CopySnapshotLayer: %v", err)
	}
	for f, want := range map[string]string{"a": "parent-a\n", "b": "fork1-b\n", "c": "fork2-c\n"} {
		if b, err := os.ReadFile(filepath.Join(upper, f)); err != nil || string(b) != want {
			t.Errorf("a pod fork's upper directory: /%s is %q (%v), want %q", f, b, err, want)
		}
	}
	if st, err := os.Lstat(filepath.Join(upper, "d")); err != nil || st.Mode()&os.ModeCharDevice == 0 {
		t.Errorf("a pod fork's upper directory: /d is %v (%v), want a whiteout", st, err)
	}
	if err := lf.RemoveSnapshot(ctx, kept.Snapshot); err != nil {
		t.Error(err)
	}
}

// plainRestore restores an exported archive with containerd's runc shim (no
// LazyFork), as a user of the standard tools would: a fresh container of the
// image with the archive's spec, rootfs-diff.tar applied to its rootfs, and
// runc restoring the archive's checkpoint/ directory.
func plainRestore(t *testing.T, ctx context.Context, e *lfEnv, img containerd.Image, sn, archivePath, id string) containerd.Task {
	t.Helper()
	unpacked := t.TempDir()
	untar(t, archivePath, unpacked)
	var spec specs.Spec
	if err := json.Unmarshal(mustRead(t, filepath.Join(unpacked, "spec.dump")), &spec); err != nil {
		t.Fatal(err)
	}
	spec.Linux.CgroupsPath = e.CgroupPath(id)
	ctr, err := e.Client().NewContainer(ctx, id,
		containerd.WithImage(img),
		containerd.WithSnapshotter(sn),
		containerd.WithNewSnapshot(id, img),
		containerd.WithSpec(&spec),
		containerd.WithRuntime("io.containerd.runc.v2", e.RuntimeOptions()),
	)
	if err != nil {
		t.Fatal(err)
	}
	mounts, err := e.Client().SnapshotService(sn).Mounts(ctx, id)
	if err != nil {
		t.Fatal(err)
	}
	if err := mount.WithTempMount(ctx, mounts, func(root string) error {
		f, err := os.Open(filepath.Join(unpacked, "rootfs-diff.tar"))
		if err != nil {
			return err
		}
		defer f.Close()
		layer, err := compression.DecompressStream(f)
		if err != nil {
			return err
		}
		defer layer.Close()
		_, err = archive.Apply(ctx, root, layer)
		return err
	}); err != nil {
		t.Fatalf("apply rootfs-diff.tar of %s: %v", archivePath, err)
	}
	task, err := e.StartTask(ctx, ctr, containerd.WithRestoreImagePath(filepath.Join(unpacked, "checkpoint")))
	if err != nil {
		t.Fatalf("plain runc restore of %s: %v", archivePath, err)
	}
	assertOwnCgroups(t, task.Pid(), spec.Linux.CgroupsPath)
	return task
}

// assertOwnCgroups checks that process pid sits in cgroup path in every
// hierarchy that names a path for it (a dump that recorded only its tasks'
// cgroup paths puts a plain restore back into its source's cgroups).
func assertOwnCgroups(t *testing.T, pid uint32, path string) {
	t.Helper()
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/cgroup", pid))
	if err != nil {
		t.Fatal(err)
	}
	for _, l := range strings.Split(strings.TrimSpace(string(b)), "\n") {
		f := strings.SplitN(l, ":", 3)
		if len(f) == 3 && (strings.Contains(f[1], "memory") || strings.Contains(f[1], "pids") || f[1] == "") && f[2] != path {
			t.Errorf("restored process %d is in cgroup %s (%s), want %s", pid, f[2], l, path)
		}
	}
}
