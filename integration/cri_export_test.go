package integration

import (
	"bytes"
	"errors"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/containerd/containerd/v2/pkg/namespaces"
	runtimeapi "k8s.io/cri-api/pkg/apis/runtime/v1"

	"github.com/lazyfork/lazyfork/api"
	"github.com/lazyfork/lazyfork/integration/harness"
	"github.com/lazyfork/lazyfork/integration/workloads"
)

// criCLI runs the built lazyfork binary against stack c in CRI's containerd
// namespace, as an operator on a Kubernetes node does.
func (c *criEnv) criCLI(t *testing.T, args ...string) (string, error) {
	t.Helper()
	full := append([]string{"--address", c.Address, "--namespace", harness.CRINamespace, "--root", c.Root}, args...)
	cmd := exec.Command(filepath.Join(c.Bin, "lazyfork"), full...)
	var out, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &stderr
	if err := cmd.Run(); err != nil {
		return out.String(), errors.New(strings.TrimSpace(stderr.String()) + " (" + err.Error() + ")")
	}
	return out.String(), nil
}

// TestCRIExportForkPod: an export of a pod's container restores through the
// kubelet/CRI path. containerd 2.4's CRI restores no archive itself
// (CreateContainer takes no checkpoint archive as image), so the path is
// LazyFork's: `lazyfork -n k8s.io import` turns the export into a snapshot on
// the node, and a pod annotated lazyfork.io/fork-of with its directory starts
// as a fork of it, on this stack and on a second private stack with its own
// root and tmpfs (another node). Each fork continues the parent's count with
// the parent's files, maps that node's memory files and uses under 2 MB; a
// pod of another Kubernetes namespace is refused as it is for the original;
// deleting the imported container leaves no snapshot.
func TestCRIExportForkPod(t *testing.T) {
	c := startCRI(t)
	ctx := c.ctx(t)
	parentPod := c.runPod(t, ctx, "parent", true, forkableAnn)
	parent := c.run(t, ctx, parentPod, parentPod.containerConfig("counter", harness.PythonImage, layerWriterArgs, nil))
	plog := parentPod.logPath("counter")
	if _, err := waitTickAbove(ctx, plog, 2); err != nil {
		t.Fatal(err)
	}
	archive := filepath.Join(t.TempDir(), "counter.tar")
	before := lastOf(ticks(plog))
	if msg, err := c.criCLI(t, "export", parent, "-o", archive); err != nil {
		t.Fatalf("lazyfork export of a pod's container: %v", err)
	} else {
		t.Logf("export: %s", strings.TrimSpace(msg))
	}
	after := lastOf(ticks(plog))
	if _, err := waitTickAbove(ctx, plog, after); err != nil {
		t.Fatalf("parent stopped after the export: %v", err)
	}

	c2 := startCRI(t)
	for i, node := range []*criEnv{c, c2} {
		nctx := node.ctx(t)
		kctx := namespaces.WithNamespace(nctx, harness.CRINamespace)
		name := "imported"
		if msg, err := node.criCLI(t, "import", archive, "--name", name, "--cgroup-parent", node.CgroupParent); err != nil {
			t.Fatalf("stack %d: lazyfork import: %v", i+1, err)
		} else {
			t.Logf("stack %d: import: %s", i+1, strings.TrimSpace(msg))
		}
		ctr, err := node.Client().LoadContainer(kctx, name)
		if err != nil {
			t.Fatal(err)
		}
		labels, err := ctr.Labels(kctx)
		if err != nil {
			t.Fatal(err)
		}
		snap := labels[api.LabelStopped]
		if snap == "" {
			t.Fatalf("stack %d: the imported container has no snapshot (labels %v)", i+1, labels)
		}
		if i == 1 {
			// Only pods the original admitted: its Kubernetes namespace.
			op := node.runPodIn(t, nctx, "other", "thief", true, map[string]string{"lazyfork.io/fork-of": snap})
			node.refusedFork(t, nctx, op, "permission denied")
		}

		forkPod := node.runPod(t, nctx, "fork", true, map[string]string{"lazyfork.io/fork-of": snap})
		fork := node.run(t, nctx, forkPod, forkPod.containerConfig("counter", harness.PythonImage, layerWriterArgs, nil))
		flog := forkPod.logPath("counter")
		first, err := waitTickAbove(nctx, flog, 0)
		if err != nil {
			t.Fatal(err)
		}
		if first <= before || first > after+1 {
			t.Fatalf("stack %d: fork's first tick %d, want in (%d, %d]: it did not continue the count from the export", i+1, first, before, after+1)
		}
		if lines, _ := criLines(flog); len(lines) > 0 && workloads.IsReady(lines[0]) {
			t.Fatalf("stack %d: fork started afresh: %q", i+1, lines[0])
		}
		if _, err := waitTickAbove(nctx, flog, first+1); err != nil {
			t.Fatalf("stack %d: fork does not keep counting: %v", i+1, err)
		}
		node.checkParentLayer(t, nctx, fork)
		task, err := node.Client().LoadContainer(kctx, fork)
		if err != nil {
			t.Fatal(err)
		}
		ft, err := task.Task(kctx, nil)
		if err != nil {
			t.Fatal(err)
		}
		if !mapsMemFiles(t, ft.Pid()) {
			t.Errorf("stack %d: the fork maps no memory file", i+1)
		}
		st, err := node.rt.ContainerStats(nctx, &runtimeapi.ContainerStatsRequest{ContainerId: fork})
		if err != nil {
			t.Fatal(err)
		}
		if usage := st.Stats.GetMemory().GetUsageBytes().GetValue(); usage == 0 || usage >= 2<<20 {
			t.Errorf("stack %d: fork memory %d B, want under 2 MB (its 64 MiB heap in memory files)", i+1, usage)
		}
		node.stopRemove(t, nctx, forkPod)
		if _, err := node.criCLI(t, "delete", name); err != nil {
			t.Errorf("stack %d: delete the imported container: %v", i+1, err)
		}
		if left := dirNames(t, filepath.Join(node.Root, "snapshots")); len(left) != 0 {
			t.Errorf("stack %d: snapshots left: %v", i+1, left)
		}
	}
	if _, err := waitTickAbove(ctx, plog, lastOf(ticks(plog))); err != nil {
		t.Fatalf("parent stopped: %v", err)
	}
	c.stopRemove(t, ctx, parentPod)
}
