package integration

import (
	"os"
	"path/filepath"
	"strings"
	"testing"

	containerd "github.com/containerd/containerd/v2/client"
	"github.com/containerd/containerd/v2/pkg/oci"

	"github.com/lazyfork/lazyfork/api"
	"github.com/lazyfork/lazyfork/integration/harness"
	snapclient "github.com/lazyfork/lazyfork/snapshotter/client"
)

// TestLabelsNameNoOneElsesFiles: LazyFork's labels are not LazyFork's alone to
// write (CRI copies an image's labels onto its containers, and any containerd
// client may set them), so a container whose labels name another container's
// snapshot and a file of the host gets neither forked nor removed on its
// behalf: fork refuses it, delete removes only the container, and the victim
// still forks and counts on.
func TestLabelsNameNoOneElsesFiles(t *testing.T) {
	e := startCLIEnv(t)
	ctx := e.ctx(t)
	img, err := e.ImportImage(ctx, "python", harness.WithSnapshotter(snapclient.SnapshotterName))
	if err != nil {
		t.Fatal(err)
	}
	pyRef, _ := harness.ImageRef("python")
	e.must(t, "create", "--name", "victim", pyRef, "--", "python3", counterPy, "8", "--interval", "0.05")
	before := e.waitTick(t, "victim", 3)
	e.must(t, "stop", "victim")
	victim, err := e.Client().LoadContainer(ctx, "victim")
	if err != nil {
		t.Fatal(err)
	}
	vl, err := victim.Labels(ctx)
	if err != nil || vl[api.LabelStopped] == "" {
		t.Fatalf("victim's labels after stop: %v %v", vl, err)
	}
	snap := vl[api.LabelStopped]

	precious := filepath.Join(t.TempDir(), "precious.log")
	if err := os.WriteFile(precious, []byte("keep me\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	// The attacker: a LazyFork container (no task) whose labels name the
	// victim's snapshot and a file that is not its log.
	if _, err := e.Client().NewContainer(ctx, "attacker",
		containerd.WithImage(img),
		containerd.WithSnapshotter(snapclient.SnapshotterName),
		containerd.WithNewSnapshot("attacker-rootfs", img),
		containerd.WithRuntime(api.RuntimeName, nil),
		containerd.WithNewSpec(oci.WithImageConfig(img)),
		containerd.WithContainerLabels(map[string]string{api.LabelStopped: snap, api.LabelLog: precious}),
	); err != nil {
		t.Fatal(err)
	}
	out, err := e.lf(t, "fork", "attacker")
	if err == nil || !strings.Contains(err.Error(), "not of this container") {
		t.Errorf("fork of a container whose label names another's snapshot: %v\n%s", err, out)
	}
	e.must(t, "delete", "attacker")
	if b, err := os.ReadFile(precious); err != nil || string(b) != "keep me\n" {
		t.Errorf("delete removed the file the attacker's label named: %q %v", b, err)
	}
	if _, err := os.Stat(snap); err != nil {
		t.Errorf("delete removed the victim's snapshot the attacker's label named: %v", err)
	}
	// The victim is whole: it forks, and the fork counts on from its stop.
	fork := strings.TrimSpace(e.must(t, "fork", "victim"))
	e.waitTick(t, fork, 0)
	fout, _ := e.lf(t, "attach", fork, "--follow=false")
	if ft := firstTick(t, fout); ft <= before {
		t.Errorf("the victim's fork starts at tick %d, not after %d", ft, before)
	}
}
