package integration

import (
	"archive/tar"
	"bytes"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/lazyfork/lazyfork/api"
	lfclient "github.com/lazyfork/lazyfork/client"
	"github.com/lazyfork/lazyfork/integration/harness"
	"github.com/lazyfork/lazyfork/integration/workloads"
	"github.com/lazyfork/lazyfork/internal/testutil"
)

// checkpointctlVersion is the checkpointctl whose CLI the tests build (the
// newest release whose dependencies the module proxy serves; its library is
// the one go.mod requires).
const checkpointctlVersion = "v1.6.0"

// buildCheckpointctl builds checkpointctl's CLI from its Go module into a
// temporary directory.
func buildCheckpointctl(t *testing.T) string {
	t.Helper()
	dir := t.TempDir()
	cmd := exec.Command("go", "install", "github.com/checkpoint-restore/checkpointctl@"+checkpointctlVersion)
	cmd.Dir = dir
	cmd.Env = append(os.Environ(), "GOBIN="+dir, "GOFLAGS=-mod=mod", "GOWORK=off")
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("build checkpointctl %s: %v\n%s", checkpointctlVersion, err, out)
	}
	return filepath.Join(dir, "checkpointctl")
}

// lfCLI runs the built lazyfork binary against stack e (no snapshotter
// plugin: rootfs on overlayfs).
func (e *lfEnv) lfCLI(t *testing.T, args ...string) (string, error) {
	t.Helper()
	full := append([]string{"--address", e.Address, "--namespace", e.Namespace, "--root", e.Root}, args...)
	cmd := exec.Command(filepath.Join(e.Bin, "lazyfork"), full...)
	var out, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &stderr
	if err := cmd.Run(); err != nil {
		return out.String(), errors.New(strings.TrimSpace(stderr.String()) + " (" + err.Error() + ")")
	}
	return out.String(), nil
}

// untar extracts a (flat, trusted) test archive into dir.
func untar(t *testing.T, archivePath, dir string) {
	t.Helper()
	f, err := os.Open(archivePath)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	tr := tar.NewReader(f)
	for {
		h, err := tr.Next()
		if errors.Is(err, io.EOF) {
			return
		}
		if err != nil {
			t.Fatal(err)
		}
		p := filepath.Join(dir, filepath.Clean("/"+h.Name))
		switch h.Typeflag {
		case tar.TypeDir:
			if err := os.MkdirAll(p, 0o755); err != nil {
				t.Fatal(err)
			}
		case tar.TypeReg:
			if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
				t.Fatal(err)
			}
			b, err := io.ReadAll(tr)
			if err != nil {
				t.Fatal(err)
			}
			if err := os.WriteFile(p, b, 0o600); err != nil {
				t.Fatal(err)
			}
		}
	}
}

// mapsMemFiles reports whether process pid maps a LazyFork memory file.
func mapsMemFiles(t *testing.T, pid uint32) bool {
	t.Helper()
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/maps", pid))
	if err != nil {
		t.Fatal(err)
	}
	return strings.Contains(string(b), "/.lazyfork/mem/")
}

// TestExportImport exports a running LazyFork counter (its memory in memory
// files) as a checkpoint archive and checks that the standard tools take it:
// checkpointctl (built from its Go module) shows and inspects it, stats
// included; plain runc, through containerd's runc shim, restores it into a
// process that continues the count with its whole heap and no memory file;
// and a second private stack with its own root and tmpfs (another host)
// imports it as a stopped container whose forks continue the count, mapping
// that stack's own memory files. A corrupt archive, a file that is no
// archive and a name clash fail with a clear error and leave nothing.
func TestExportImport(t *testing.T) {
	testutil.RequiresBinary(t, "runc")
	testutil.RequiresBinary(t, "go")
	cctl := buildCheckpointctl(t)
	e, ctx, img := startLFPython(t)
	const heap = 16
	parent := e.startCounter(t, ctx, img, "exp", heap)

	// Export through the CLI: the running container is snapshotted and
	// keeps counting.
	out := filepath.Join(t.TempDir(), "exp.tar")
	msg, err := e.lfCLI(t, "export", "exp", "-o", out)
	if err != nil {
		t.Fatalf("lazyfork export: %v", err)
	}
	t.Logf("export: %s", strings.TrimSpace(msg))
	parent.waitLine(t, ctx, len(parent.lines(t)), "tick ")
	if left := e.snapshotsLeft(t); len(left) != 0 {
		t.Errorf("export left snapshots behind: %v", left)
	}
	if _, err := e.lfCLI(t, "export", "exp", "-o", out); err == nil || !strings.Contains(err.Error(), "exists") {
		t.Errorf("export onto an existing file: %v, want an error saying it exists", err)
	}

	// checkpointctl reads it: show, inspect with every option, and the
	// command line and environment, which it reads from the image's memory
	// pages (so they are really there).
	for _, c := range []struct {
		args []string
		want []string
	}{
		{[]string{"show", out}, []string{"exp", "containerd", api.RuntimeName}},
		{[]string{"inspect", "--all", out}, []string{"CRIU dump statistics", "Pages written", "Memory pages size", "Process tree", "Overview of mounts"}},
		{[]string{"inspect", "--ps-tree-cmd", out}, []string{"counter.py"}},
		{[]string{"inspect", "--ps-tree-env", out}, []string{"PATH="}},
	} {
		b, err := exec.Command(cctl, c.args...).CombinedOutput()
		if err != nil {
			t.Fatalf("checkpointctl %s: %v\n%s", strings.Join(c.args, " "), err, b)
		}
		for _, want := range c.want {
			if !strings.Contains(string(b), want) {
				t.Errorf("checkpointctl %s: no %q in\n%s", strings.Join(c.args, " "), want, b)
			}
		}
	}

	// A plain runc restore (containerd's runc shim, no LazyFork) continues
	// the count with the whole heap, from ordinary anonymous memory.
	ptask := plainRestore(t, ctx, e, img, "overlayfs", out, "plain") // checks its cgroups too
	unpacked := t.TempDir()
	untar(t, out, unpacked)
	pc := &counter{e: e, id: "plain", task: ptask}
	checkContinues(t, ctx, parent, pc)
	if line, err := workloads.Verify(ctx, ptask, pc.log()); err != nil || !strings.Contains(line, fmt.Sprintf("pages=%d writes=0", heap*256)) {
		t.Errorf("plain restore's heap: %q %v", line, err)
	}
	if mapsMemFiles(t, ptask.Pid()) {
		t.Errorf("the plain restore maps LazyFork memory files")
	}

	// A checkpoint archive as CRI writes one of a LazyFork container holds
	// the rewritten image: it imports where its memory files are...
	snap, err := e.lfClient().Checkpoint(ctx, "exp")
	if err != nil {
		t.Fatal(err)
	}
	criFiles := map[string][]byte{
		"config.dump": mustRead(t, filepath.Join(unpacked, "config.dump")),
		"spec.dump":   mustRead(t, filepath.Join(unpacked, "spec.dump")),
	}
	ents, err := os.ReadDir(snap.Snapshot)
	if err != nil {
		t.Fatal(err)
	}
	for _, d := range ents {
		if d.Type().IsRegular() {
			criFiles["checkpoint/"+d.Name()] = mustRead(t, filepath.Join(snap.Snapshot, d.Name()))
		}
	}
	criArchive := filepath.Join(t.TempDir(), "cri.tar")
	writeTar(t, criArchive, criFiles)
	if _, err := e.lfCLI(t, "import", criArchive, "--name", "same", "--cgroup-parent", e.CgroupParent); err != nil {
		t.Errorf("import a CRI archive of a LazyFork container on its own host: %v", err)
	} else if err := e.lfClient().Delete(ctx, "same"); err != nil {
		t.Error(err)
	}
	// A kept snapshot exports by its directory too.
	out2 := filepath.Join(t.TempDir(), "snap.tar")
	if _, err := e.lfCLI(t, "export", snap.Snapshot, "-o", out2); err != nil {
		t.Errorf("lazyfork export SNAPSHOT: %v", err)
	} else if b, err := exec.Command(cctl, "inspect", "--ps-tree-cmd", out2).CombinedOutput(); err != nil || !strings.Contains(string(b), "counter.py") {
		t.Errorf("checkpointctl inspect of the snapshot's export: %v\n%s", err, b)
	}
	if err := e.lfClient().RemoveSnapshot(ctx, snap.Snapshot); err != nil {
		t.Error(err)
	}

	// Another host: a second private stack with its own root and tmpfs.
	e2 := startLF(t, harness.Options{})
	ctx2 := e2.ctx(t)
	if _, err := e2.ImportImage(ctx2, "python"); err != nil {
		t.Fatal(err)
	}
	if e2.Root == e.Root {
		t.Fatal("the stacks share a root")
	}
	before := dirNames(t, filepath.Join(e2.Root, "snapshots"))
	memBefore := dirNames(t, filepath.Join(e2.Root, "mem"))

	// What is not an archive, or is a broken one, fails and leaves nothing.
	junk := filepath.Join(t.TempDir(), "junk.tar")
	if err := os.WriteFile(junk, bytes.Repeat([]byte("not a tar "), 200), 0o600); err != nil {
		t.Fatal(err)
	}
	broken := filepath.Join(t.TempDir(), "broken.tar")
	writeTar(t, broken, map[string][]byte{
		"config.dump":              mustRead(t, filepath.Join(unpacked, "config.dump")),
		"spec.dump":                mustRead(t, filepath.Join(unpacked, "spec.dump")),
		"checkpoint/inventory.img": []byte("garbage"),
		"checkpoint/pstree.img":    []byte("garbage"),
		"checkpoint/files.img":     []byte("garbage"),
	})
	for _, c := range []struct{ file, want string }{
		{junk, "not a checkpoint archive"},
		{broken, "files image"},
		// ...and not where they are not: the error says what to do.
		{criArchive, "make it with `lazyfork export` where it was taken"},
	} {
		_, err := e2.lfCLI(t, "import", c.file, "--name", "bad", "--cgroup-parent", e2.CgroupParent)
		if err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("import %s: %v, want an error with %q", filepath.Base(c.file), err, c.want)
		}
		if _, err := e2.Client().LoadContainer(ctx2, "bad"); err == nil {
			t.Errorf("import %s left a container", filepath.Base(c.file))
		}
	}
	if got := dirNames(t, filepath.Join(e2.Root, "snapshots")); !equalSets(got, before) {
		t.Errorf("failed imports left snapshots: %v (before %v)", got, before)
	}
	if got := dirNames(t, filepath.Join(e2.Root, "mem")); !equalSets(got, memBefore) {
		t.Errorf("failed imports left memory families: %v (before %v)", got, memBefore)
	}

	msg, err = e2.lfCLI(t, "import", out, "--name", "imp", "--cgroup-parent", e2.CgroupParent)
	if err != nil {
		t.Fatalf("lazyfork import on the second stack: %v", err)
	}
	t.Logf("import: %s", strings.TrimSpace(msg))
	if _, err := e2.lfCLI(t, "import", out, "--name", "imp", "--cgroup-parent", e2.CgroupParent); err == nil || !strings.Contains(err.Error(), "exists already") {
		t.Errorf("import under a taken name: %v, want an error saying it exists", err)
	}
	snaps := dirNames(t, filepath.Join(e2.Root, "snapshots"))
	if len(snaps) != len(before)+1 {
		t.Errorf("snapshots after one import and a clash: %v", snaps)
	}

	// Forkable at once: its forks continue the count from the export.
	lf2 := e2.lfClient()
	res, err := lf2.Fork(ctx2, "imp", 2, e2.logIO(), lfclient.WithIDs("imp-a", "imp-b"))
	if err != nil {
		t.Fatalf("fork the imported container: %v", err)
	}
	for _, f := range e2.forks(res) {
		checkContinues(t, ctx2, parent, f)
		if line, err := workloads.Verify(ctx2, f.task, f.log()); err != nil || !strings.Contains(line, fmt.Sprintf("pages=%d writes=0", heap*256)) {
			t.Errorf("%s heap: %q %v", f.id, line, err)
		}
		if !mapsMemFiles(t, f.task.Pid()) {
			t.Errorf("%s maps no memory file of the second stack", f.id)
		}
	}
	if fam, err := os.ReadDir(filepath.Join(e2.Root, "mem", res.Family)); err != nil || len(fam) == 0 {
		t.Errorf("family %s on the second stack: %v (%d files)", res.Family, err, len(fam))
	}
	// The imported container goes like a stopped one, snapshot and all.
	for _, id := range []string{"imp-a", "imp-b"} {
		if err := lf2.Delete(ctx2, id); err != nil {
			t.Error(err)
		}
	}
	if err := lf2.Delete(ctx2, "imp"); err != nil {
		t.Fatal(err)
	}
	if got := dirNames(t, filepath.Join(e2.Root, "snapshots")); !equalSets(got, before) {
		t.Errorf("delete of the imported container left snapshots: %v", got)
	}
}

func mustRead(t *testing.T, p string) []byte {
	t.Helper()
	b, err := os.ReadFile(p)
	if err != nil {
		t.Fatal(err)
	}
	return b
}

func writeTar(t *testing.T, p string, files map[string][]byte) {
	t.Helper()
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	for name, b := range files {
		if err := tw.WriteHeader(&tar.Header{Name: name, Mode: 0o600, Size: int64(len(b)), Typeflag: tar.TypeReg}); err != nil {
			t.Fatal(err)
		}
		if _, err := tw.Write(b); err != nil {
			t.Fatal(err)
		}
	}
	if err := tw.Close(); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(p, buf.Bytes(), 0o600); err != nil {
		t.Fatal(err)
	}
}

// dirNames lists a directory's entries, hidden ones (state, views) left out.
func dirNames(t *testing.T, dir string) []string {
	t.Helper()
	ents, err := os.ReadDir(dir)
	if err != nil && !os.IsNotExist(err) {
		t.Fatal(err)
	}
	var out []string
	for _, e := range ents {
		if !strings.HasPrefix(e.Name(), ".") {
			out = append(out, e.Name())
		}
	}
	return out
}

func equalSets(a, b []string) bool {
	if len(a) != len(b) {
		return false
	}
	m := map[string]bool{}
	for _, x := range a {
		m[x] = true
	}
	for _, x := range b {
		if !m[x] {
			return false
		}
	}
	return true
}
