package integration

import (
	"archive/tar"
	"context"
	"errors"
	"io"
	"net"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/containerd/containerd/v2/pkg/namespaces"
	runtimeapi "k8s.io/cri-api/pkg/apis/runtime/v1"

	lfclient "github.com/lazyfork/lazyfork/client"
	"github.com/lazyfork/lazyfork/integration/harness"
	"github.com/lazyfork/lazyfork/integration/workloads"
	"github.com/lazyfork/lazyfork/memfile"
	"github.com/lazyfork/lazyfork/memfile/madvguard"
)

// TestCRIPodLifecycle drives a host-network pod under the lazyfork handler
// through CRI the way kubelet does: run sandbox, create/start two containers,
// logs, exec, stats, stop, remove; one shim process serves the whole pod.
func TestCRIPodLifecycle(t *testing.T) {
	c := startCRI(t)
	ctx := c.ctx(t)
	p := c.runPod(t, ctx, "life", true, nil)

	counter := c.run(t, ctx, p, p.containerConfig("counter", harness.PythonImage, workloads.CounterArgs(8), nil))
	sleeper := c.run(t, ctx, p, p.containerConfig("sleeper", harness.BusyboxImage, []string{"sh", "-c", "echo hello from busybox; exec sleep 100000"}, nil))

	// logs: CRI's log files
	if _, err := waitTickAbove(ctx, p.logPath("counter"), 1); err != nil {
		t.Fatal(err)
	}
	if _, err := waitLog(ctx, p.logPath("sleeper"), func(l string) bool { return l == "hello from busybox" }); err != nil {
		t.Fatal(err)
	}

	// exec: LazyFork's additions are there
	out, code, err := c.execSync(ctx, sleeper, "sh", "-c", "cat /proc/sys/vm/overcommit_memory; grep -c ' /.lazyfork/mem ' /proc/self/mounts")
	if err != nil || code != 0 {
		t.Fatalf("ExecSync: %v (exit %d) %s", err, code, out)
	}
	if f := strings.Fields(out); len(f) != 2 || f[0] != "2" || f[1] != "1" {
		t.Errorf("exec output %q, want overcommit 2 and one /.lazyfork/mem mount", out)
	}
	if _, code, err := c.execSync(ctx, counter, "false"); err != nil || code != 1 {
		t.Errorf("exec false: exit %d, %v; want exit 1", code, err)
	}

	// stats
	for _, id := range []string{counter, sleeper} {
		st, err := c.rt.ContainerStats(ctx, &runtimeapi.ContainerStatsRequest{ContainerId: id})
		if err != nil {
			t.Fatalf("ContainerStats: %v", err)
		}
		if st.Stats.GetMemory().GetWorkingSetBytes().GetValue() == 0 || st.Stats.GetCpu() == nil {
			t.Errorf("ContainerStats %s: %v, want memory and cpu", id, st.Stats)
		}
	}
	// status
	cs, err := c.rt.ContainerStatus(ctx, &runtimeapi.ContainerStatusRequest{ContainerId: counter})
	if err != nil || cs.Status.State != runtimeapi.ContainerState_CONTAINER_RUNNING {
		t.Fatalf("ContainerStatus: %v %v", cs, err)
	}

	// One shim process serves the pod (sandbox + two containers).
	if pids := harness.ShimPIDs(c.Address); len(pids) != 1 {
		t.Errorf("shim processes for one pod: %v, want 1", pids)
	}

	c.stopRemove(t, ctx, p)
	if l, err := c.rt.ListContainers(ctx, &runtimeapi.ListContainersRequest{}); err != nil || len(l.Containers) != 0 {
		t.Errorf("containers left after removing the pod: %v %v", l, err)
	}
	if l, err := c.rt.ListPodSandbox(ctx, &runtimeapi.ListPodSandboxRequest{}); err != nil || len(l.Items) != 0 {
		t.Errorf("pods left: %v %v", l, err)
	}
}

// TestCRIPodNetwork: a lazyfork pod with its own network namespace on a private
// bridge CNI network gets an address of that network, seen inside the container.
func TestCRIPodNetwork(t *testing.T) {
	c := startCRI(t)
	ctx := c.ctx(t)
	nw, err := c.AddBridgeNetwork(ctx)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := nw.Remove(); err != nil {
			t.Error(err)
		}
	})
	p := c.runPod(t, ctx, "net", false, nil)
	st, err := c.rt.PodSandboxStatus(ctx, &runtimeapi.PodSandboxStatusRequest{PodSandboxId: p.id})
	if err != nil {
		t.Fatal(err)
	}
	ip := st.GetStatus().GetNetwork().GetIp()
	_, subnet, _ := net.ParseCIDR(nw.Subnet)
	if parsed := net.ParseIP(ip); parsed == nil || !subnet.Contains(parsed) {
		t.Fatalf("pod IP %q, want one in %s", ip, nw.Subnet)
	}
	id := c.run(t, ctx, p, p.containerConfig("app", harness.BusyboxImage, []string{"sleep", "100000"}, nil))
	out, code, err := c.execSync(ctx, id, "ip", "-4", "addr")
	if err != nil || code != 0 || !strings.Contains(out, ip+"/") {
		t.Fatalf("ip addr in the pod: %v (exit %d): %s; want %s", err, code, out, ip)
	}
	host, _ := os.Hostname()
	if out, _, _ := c.execSync(ctx, id, "hostname"); strings.TrimSpace(out) != "net" || host == "net" {
		t.Errorf("pod hostname %q, want net", out)
	}
	c.stopRemove(t, ctx, p)
}

// TestCRICheckpointForkPod: CRI CheckpointContainer of a lazyfork container
// writes containerd's archive holding a LazyFork snapshot (with its madvise
// guard); a pod annotated lazyfork.io/fork-of=<archive> starts its container
// as a fork that continues the parent's counter in under 2 MB of its own
// memory; bad annotations are clear CRI errors that leave nothing behind;
// removing the fork's pod leaves the parent running.
func TestCRICheckpointForkPod(t *testing.T) {
	c := startCRI(t)
	ctx := c.ctx(t)
	parentPod := c.runPod(t, ctx, "parent", true, forkableAnn)
	parent := c.run(t, ctx, parentPod, parentPod.containerConfig("counter", harness.PythonImage, layerWriterArgs, nil))
	plog := parentPod.logPath("counter")
	if _, err := waitTickAbove(ctx, plog, 2); err != nil {
		t.Fatal(err)
	}

	archiveDir := c.archiveDir
	archive := filepath.Join(archiveDir, "counter.tar")
	before := lastOf(ticks(plog))
	if _, err := c.rt.CheckpointContainer(ctx, &runtimeapi.CheckpointContainerRequest{ContainerId: parent, Location: archive}); err != nil {
		t.Fatalf("CheckpointContainer: %v", err)
	}
	after := lastOf(ticks(plog))
	// The parent keeps running (leave-running: CRI sends no options).
	if _, err := waitTickAbove(ctx, plog, after); err != nil {
		t.Fatalf("parent stopped after the checkpoint: %v", err)
	}
	// It was moved onto its snapshot's memory file in place: CRI sees the
	// same container RUNNING, started once, and no exit.
	ps, err := c.rt.ContainerStatus(ctx, &runtimeapi.ContainerStatusRequest{ContainerId: parent})
	if err != nil || ps.Status.State != runtimeapi.ContainerState_CONTAINER_RUNNING || ps.Status.FinishedAt != 0 {
		t.Fatalf("parent after its checkpoint, as CRI sees it: %+v %v", ps.GetStatus(), err)
	}
	if !strings.Contains(c.Log(), "moved onto memory file") {
		t.Errorf("the parent was not moved onto its memory file at its CRI checkpoint")
	}
	// The archive is containerd's, with a LazyFork snapshot inside it.
	img := extractCheckpoint(t, archive)
	if _, err := memfile.ReadSnapshot(img); err != nil {
		t.Fatalf("archive holds no LazyFork snapshot: %v", err)
	}
	if ok, err := madvguard.Installed(img); err != nil || !ok {
		t.Errorf("archive's snapshot has no madvise guard: %v %v", ok, err)
	}

	snapshots := filepath.Join(c.Root, "snapshots")
	// Bad annotations: CRI creates containers without the runtime, so the
	// error comes at StartContainer (kubelet then removes the container and
	// retries); it names the annotation and LazyFork leaves nothing behind.
	// An archive outside the shim's archive directories is refused too
	// (whatever it holds: the shim never reads it).
	outside, err := c.TempDir("ckpt-")
	if err != nil {
		t.Fatal(err)
	}
	stray := filepath.Join(outside, "counter.tar")
	if err := os.Link(archive, stray); err != nil {
		t.Fatal(err)
	}
	for _, bad := range []string{"/nonexistent/snapshot", archiveDir, writeGarbage(t, archiveDir), stray} {
		bp := c.runPod(t, ctx, "bad", true, map[string]string{"lazyfork.io/fork-of": bad})
		id, err := c.create(ctx, bp, bp.containerConfig("counter", harness.PythonImage, workloads.CounterArgs(64), nil))
		if err != nil {
			t.Fatalf("CreateContainer: %v", err)
		}
		_, err = c.rt.StartContainer(ctx, &runtimeapi.StartContainerRequest{ContainerId: id})
		if err == nil || !strings.Contains(err.Error(), "lazyfork.io/fork-of") {
			t.Errorf("fork-of %s: StartContainer %v, want a CRI error naming the annotation", bad, err)
		}
		t.Logf("fork-of %s: StartContainer: %v", bad, err)
		if st, err := c.rt.ContainerStatus(ctx, &runtimeapi.ContainerStatusRequest{ContainerId: id}); err != nil ||
			st.Status.State == runtimeapi.ContainerState_CONTAINER_RUNNING {
			t.Errorf("fork-of %s: container %v %v, want not running", bad, st, err)
		}
		if ents, _ := os.ReadDir(snapshots); len(ents) != 0 {
			t.Errorf("fork-of %s left %v in %s", bad, ents, snapshots)
		}
		if pids := harness.ShimPIDs(c.Address); len(pids) != 2 { // the parent's pod and the bad pod's sandbox
			t.Errorf("fork-of %s: shims %v, want 2", bad, pids)
		}
		c.stopRemove(t, ctx, bp)
	}

	// A pod of another Kubernetes namespace cannot fork the parent, even
	// from its archive.
	op := c.runPodIn(t, ctx, "other", "thief", true, map[string]string{"lazyfork.io/fork-of": archive})
	c.refusedFork(t, ctx, op, "permission denied")
	if ents, _ := os.ReadDir(snapshots); len(ents) != 0 {
		t.Errorf("a refused fork left %v in %s", ents, snapshots)
	}

	// The fork as a pod.
	forkPod := c.runPod(t, ctx, "fork", true, map[string]string{"lazyfork.io/fork-of": archive})
	fork := c.run(t, ctx, forkPod, forkPod.containerConfig("counter", harness.PythonImage, layerWriterArgs, nil))
	flog := forkPod.logPath("counter")
	first, err := waitTickAbove(ctx, flog, 0)
	if err != nil {
		t.Fatal(err)
	}
	if first <= before || first > after+1 {
		t.Fatalf("fork's first tick %d, want in (%d, %d]: it did not continue the parent's counter", first, before, after+1)
	}
	if lines, _ := criLines(flog); len(lines) > 0 && workloads.IsReady(lines[0]) {
		t.Fatalf("fork started afresh: %q", lines[0])
	}
	if _, err := waitTickAbove(ctx, flog, first+1); err != nil {
		t.Fatalf("fork does not keep counting: %v", err)
	}
	st, err := c.rt.ContainerStats(ctx, &runtimeapi.ContainerStatsRequest{ContainerId: fork})
	if err != nil {
		t.Fatal(err)
	}
	usage := st.Stats.GetMemory().GetUsageBytes().GetValue()
	pst, _ := c.rt.ContainerStats(ctx, &runtimeapi.ContainerStatsRequest{ContainerId: parent})
	t.Logf("parent %d B, fork %d B (usage); checkpoint between ticks %d and %d, fork resumed at %d",
		pst.GetStats().GetMemory().GetUsageBytes().GetValue(), usage, before, after, first)
	if usage == 0 || usage >= 2<<20 {
		t.Errorf("fork memory %d B, want under 2 MB", usage)
	}
	// The fork's filesystem is its parent's (the archive's rootfs-diff.tar).
	c.checkParentLayer(t, ctx, fork)
	c.gcKeepsClaimed(t, ctx, snapshots)
	// The fork is a real pod: listed, stopped and removed like any other.
	l, err := c.rt.ListContainers(ctx, &runtimeapi.ListContainersRequest{Filter: &runtimeapi.ContainerFilter{PodSandboxId: forkPod.id}})
	if err != nil || len(l.Containers) != 1 || l.Containers[0].State != runtimeapi.ContainerState_CONTAINER_RUNNING {
		t.Fatalf("fork pod containers: %v %v", l, err)
	}
	c.stopRemove(t, ctx, forkPod)
	if ents, _ := os.ReadDir(snapshots); len(ents) != 0 {
		t.Errorf("unpacked snapshot left after removing the fork: %v", ents)
	}
	now := lastOf(ticks(plog))
	if _, err := waitTickAbove(ctx, plog, now); err != nil {
		t.Fatalf("parent stopped after the fork's pod was removed: %v", err)
	}
	c.stopRemove(t, ctx, parentPod)
}

// gcKeepsClaimed checks that the snapshot directory of the one running pod
// fork, in snapshots, is its container's: lazyfork gc leaves it however old
// (the shim claimed it), as it would take an unclaimed one.
func (c *criEnv) gcKeepsClaimed(t *testing.T, ctx context.Context, snapshots string) {
	t.Helper()
	ents, err := os.ReadDir(snapshots)
	if err != nil || len(ents) != 1 {
		t.Fatalf("snapshot directories of the fork: %v %v, want one", ents, err)
	}
	dir := filepath.Join(snapshots, ents[0].Name())
	old := time.Now().Add(-2 * max(lfclient.OrphanAge, lfclient.UnclaimedAge))
	if err := os.Chtimes(dir, old, old); err != nil {
		t.Fatal(err)
	}
	if rep, err := c.lfClient().GC(ctx, false); err != nil {
		t.Errorf("lazyfork gc: %v", err)
	} else if _, err := os.Stat(dir); err != nil {
		t.Errorf("lazyfork gc removed the running fork's snapshot %s (%v): %v", dir, rep.Removed, err)
	}
}

// forkableAnn is a parent pod's opt-in to forks by pods of its namespace.
var forkableAnn = map[string]string{"lazyfork.io/forkable": "true"}

// refusedFork starts a counter container in pod p, whose fork-of must be
// refused with an error containing want; the pod is then removed.
func (c *criEnv) refusedFork(t *testing.T, ctx context.Context, p *pod, want string) {
	t.Helper()
	id, err := c.create(ctx, p, p.containerConfig("counter", harness.PythonImage, layerWriterArgs, nil))
	if err != nil {
		t.Fatalf("CreateContainer: %v", err)
	}
	_, err = c.rt.StartContainer(ctx, &runtimeapi.StartContainerRequest{ContainerId: id})
	if err == nil || !strings.Contains(err.Error(), want) || !strings.Contains(err.Error(), "lazyfork.io/fork-of") {
		t.Errorf("pod %s/%s fork-of %s: StartContainer %v, want an error naming the annotation and %q",
			p.cfg.Metadata.Namespace, p.cfg.Metadata.Name, p.cfg.Annotations["lazyfork.io/fork-of"], err, want)
	}
	c.stopRemove(t, ctx, p)
}

func lastOf(v []int) int {
	if len(v) == 0 {
		return 0
	}
	return v[len(v)-1]
}

func writeGarbage(t *testing.T, dir string) string {
	p := filepath.Join(dir, "garbage.tar")
	if err := os.WriteFile(p, []byte(strings.Repeat("not a tar ", 100)), 0o600); err != nil {
		t.Fatal(err)
	}
	return p
}

// extractCheckpoint copies checkpoint/* of a CRI archive into a temp dir.
func extractCheckpoint(t *testing.T, archive string) string {
	t.Helper()
	f, err := os.Open(archive)
	if err != nil {
		t.Fatalf("no archive: %v", err)
	}
	defer f.Close()
	dst := t.TempDir()
	tr := tar.NewReader(f)
	var names []string
	for {
		h, err := tr.Next()
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			t.Fatal(err)
		}
		names = append(names, h.Name)
		dir, file := filepath.Split(filepath.Clean(h.Name))
		if filepath.Clean(dir) != "checkpoint" || h.Typeflag != tar.TypeReg {
			continue
		}
		out, err := os.Create(filepath.Join(dst, file))
		if err != nil {
			t.Fatal(err)
		}
		if _, err := io.Copy(out, tr); err != nil {
			t.Fatal(err)
		}
		out.Close()
	}
	for _, want := range []string{"spec.dump", "config.dump", "rootfs-diff.tar"} {
		found := false
		for _, n := range names {
			found = found || filepath.Clean(n) == want
		}
		if !found {
			t.Errorf("archive has no %s (entries %v)", want, names)
		}
	}
	return dst
}

// layerWriterArgs run the counter after writing the container's layer: a new
// file, a deleted one, and a file the counter keeps open (CRIU needs it at
// restore).
var layerWriterArgs = []string{"sh", "-c", "echo from-parent > /marker && rm /etc/debian_version && exec 3>>/held-open && exec " +
	strings.Join(workloads.CounterArgs(64), " ")}

// checkParentLayer checks that a fork of a layerWriterArgs container sees its
// parent's layer.
func (c *criEnv) checkParentLayer(t *testing.T, ctx context.Context, fork string) {
	t.Helper()
	out, code, err := c.execSync(ctx, fork, "sh", "-c", "cat /marker; test -e /etc/debian_version && echo still-there; test -e /held-open && echo held")
	if err != nil || code != 0 || strings.Join(strings.Fields(out), " ") != "from-parent held" {
		t.Errorf("fork's files: %q (exit %d, %v); want the parent's /marker and /held-open, no /etc/debian_version", out, code, err)
	}
}

// TestCRIForkOfRunningContainer: lazyfork.io/fork-of names a running container
// (as NAMESPACE/POD/CONTAINER, or by id): the fork's start snapshots it, the
// fork continues its counter with its files and under 2 MB, the parent keeps
// running, and removing the fork leaves no snapshot behind. A name that is
// not running fails StartContainer, naming the annotation. A fork of a kept
// snapshot directory gets the parent's files too.
func TestCRIForkOfRunningContainer(t *testing.T) {
	c := startCRI(t)
	ctx := c.ctx(t)
	snapshots := filepath.Join(c.Root, "snapshots")
	parentPod := c.runPod(t, ctx, "web", true, forkableAnn)
	parent := c.run(t, ctx, parentPod, parentPod.containerConfig("counter", harness.PythonImage, layerWriterArgs, nil))
	plog := parentPod.logPath("counter")
	if _, err := waitTickAbove(ctx, plog, 2); err != nil {
		t.Fatal(err)
	}

	bp := c.runPod(t, ctx, "bad", true, map[string]string{"lazyfork.io/fork-of": "default/nope/counter"})
	id, err := c.create(ctx, bp, bp.containerConfig("counter", harness.PythonImage, layerWriterArgs, nil))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := c.rt.StartContainer(ctx, &runtimeapi.StartContainerRequest{ContainerId: id}); err == nil || !strings.Contains(err.Error(), "lazyfork.io/fork-of") {
		t.Errorf("fork-of a pod that does not exist: StartContainer %v, want an error naming the annotation", err)
	}
	c.stopRemove(t, ctx, bp)

	// Only pods of the parent's own Kubernetes namespace, and only a parent
	// that opted in: refused before the parent is paused or dumped.
	closedPod := c.runPod(t, ctx, "closed", true, nil)
	closed := c.run(t, ctx, closedPod, closedPod.containerConfig("counter", harness.PythonImage, layerWriterArgs, nil))
	if _, err := waitTickAbove(ctx, closedPod.logPath("counter"), 1); err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct{ ns, ref string }{
		{"other", "default/" + parentPod.cfg.Metadata.Name + "/counter"},
		{"other", parent},
		{"default", "default/" + closedPod.cfg.Metadata.Name + "/counter"},
		{"default", closed},
	} {
		p := c.runPodIn(t, ctx, tc.ns, "thief", true, map[string]string{"lazyfork.io/fork-of": tc.ref})
		c.refusedFork(t, ctx, p, "permission denied")
		if ents, _ := os.ReadDir(snapshots); len(ents) != 0 {
			t.Errorf("fork-of %s from namespace %s left %v in %s", tc.ref, tc.ns, ents, snapshots)
		}
	}
	c.stopRemove(t, ctx, closedPod)

	for _, ref := range []string{"default/" + parentPod.cfg.Metadata.Name + "/counter", parent} {
		before := lastOf(ticks(plog))
		forkPod := c.runPod(t, ctx, "web-fork", true, map[string]string{"lazyfork.io/fork-of": ref})
		fork := c.run(t, ctx, forkPod, forkPod.containerConfig("counter", harness.PythonImage, layerWriterArgs, nil))
		flog := forkPod.logPath("counter")
		first, err := waitTickAbove(ctx, flog, 0)
		if err != nil {
			t.Fatal(err)
		}
		if first <= before {
			t.Fatalf("fork-of %s: first tick %d, the parent was at %d before: it did not continue", ref, first, before)
		}
		if lines, _ := criLines(flog); len(lines) > 0 && workloads.IsReady(lines[0]) {
			t.Fatalf("fork-of %s started afresh: %q", ref, lines[0])
		}
		c.checkParentLayer(t, ctx, fork)
		c.gcKeepsClaimed(t, ctx, snapshots)
		st, err := c.rt.ContainerStats(ctx, &runtimeapi.ContainerStatsRequest{ContainerId: fork})
		if err != nil {
			t.Fatal(err)
		}
		if usage := st.Stats.GetMemory().GetUsageBytes().GetValue(); usage == 0 || usage >= 2<<20 {
			t.Errorf("fork-of %s: memory %d B, want under 2 MB", ref, usage)
		}
		c.stopRemove(t, ctx, forkPod)
		if ents, _ := os.ReadDir(snapshots); len(ents) != 0 {
			t.Errorf("fork-of %s left %v in %s after its pod went", ref, ents, snapshots)
		}
		if _, err := waitTickAbove(ctx, plog, lastOf(ticks(plog))); err != nil {
			t.Fatalf("parent stopped after fork-of %s: %v", ref, err)
		}
	}

	// A kept snapshot directory (as `lazyfork checkpoint` takes) as fork-of:
	// the fork gets the writable layer the snapshot recorded.
	kctx := namespaces.WithNamespace(ctx, harness.CRINamespace)
	kept, err := c.lfClient().Checkpoint(kctx, parent)
	if err != nil {
		t.Fatalf("checkpoint %s: %v", parent, err)
	}
	before := lastOf(ticks(plog))
	forkPod := c.runPod(t, ctx, "web-kept", true, map[string]string{"lazyfork.io/fork-of": kept.Snapshot})
	fork := c.run(t, ctx, forkPod, forkPod.containerConfig("counter", harness.PythonImage, layerWriterArgs, nil))
	if first, err := waitTickAbove(ctx, forkPod.logPath("counter"), 0); err != nil || first > before+1 {
		t.Fatalf("fork of the kept snapshot: first tick %d (%v); the snapshot was taken by tick %d", first, err, before)
	}
	c.checkParentLayer(t, ctx, fork)
	c.stopRemove(t, ctx, forkPod)
	if err := c.lfClient().RemoveSnapshot(kctx, kept.Snapshot); err != nil {
		t.Fatal(err)
	}
	if ents, _ := os.ReadDir(snapshots); len(ents) != 0 {
		t.Errorf("left %v in %s", ents, snapshots)
	}
	c.stopRemove(t, ctx, parentPod)
}
