package integration

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/containerd/cgroups/v3"
	eventstypes "github.com/containerd/containerd/api/events"
	tasksapi "github.com/containerd/containerd/api/services/tasks/v1"
	containerd "github.com/containerd/containerd/v2/client"
	"github.com/containerd/containerd/v2/pkg/cio"
	"github.com/containerd/containerd/v2/pkg/oci"
	"github.com/containerd/typeurl/v2"

	"github.com/lazyfork/lazyfork/api"
	lfclient "github.com/lazyfork/lazyfork/client"
	"github.com/lazyfork/lazyfork/integration/harness"
	"github.com/lazyfork/lazyfork/internal/testutil"
	"github.com/lazyfork/lazyfork/memfile"
	snapclient "github.com/lazyfork/lazyfork/snapshotter/client"
)

const counterPy = "/opt/lazyfork/workloads/counter.py"

// counter is a counter.py task whose output goes to a log file.
type counter struct {
	e    *lfEnv
	id   string
	task containerd.Task
}

func (c *counter) log() string { return c.e.TaskLogPath(c.id) }

func (c *counter) lines(t *testing.T) []string {
	t.Helper()
	l, err := harness.ReadLines(c.log())
	if err != nil {
		t.Fatalf("%s: %v", c.id, err)
	}
	return l
}

// waitLine waits for a line (after skip lines) starting with prefix.
func (c *counter) waitLine(t *testing.T, ctx context.Context, skip int, prefix string) string {
	t.Helper()
	ctx, cancel := context.WithTimeout(ctx, 2*time.Minute)
	defer cancel()
	l, err := harness.WaitLine(ctx, c.log(), skip, func(l string) bool { return strings.HasPrefix(l, prefix) })
	if err != nil {
		t.Fatalf("%s: %v", c.id, err)
	}
	return l
}

// lastTick is the highest tick in the log.
func (c *counter) lastTick(t *testing.T) int {
	t.Helper()
	n := 0
	for _, l := range c.lines(t) {
		if v, ok := strings.CutPrefix(l, "tick "); ok {
			if k, err := strconv.Atoi(v); err == nil && k > n {
				n = k
			}
		}
	}
	return n
}

// signal sends sig to the counter and waits for the line it answers with.
func (c *counter) signal(t *testing.T, ctx context.Context, sig syscall.Signal, prefix string) string {
	t.Helper()
	skip := len(c.lines(t))
	if err := c.task.Kill(ctx, sig); err != nil {
		t.Fatalf("%s: signal %v: %v", c.id, sig, err)
	}
	return c.waitLine(t, ctx, skip, prefix)
}

// startCounter runs counter.py holding heapMiB (and its further args) in a
// LazyFork container.
func (e *lfEnv) startCounter(t *testing.T, ctx context.Context, img containerd.Image, id string, heapMiB int, args ...string) *counter {
	t.Helper()
	_, task := e.run(t, ctx, img, id, append([]string{"python3", counterPy, strconv.Itoa(heapMiB), "--interval", "0.05"}, args...))
	c := &counter{e: e, id: id, task: task}
	c.waitLine(t, ctx, 0, "ready ")
	c.waitLine(t, ctx, 0, "tick 3")
	return c
}

// forks wraps the forks of a Result as counters.
func (e *lfEnv) forks(res *lfclient.Result) []*counter {
	var out []*counter
	for _, f := range res.Forks {
		out = append(out, &counter{e: e, id: f.Container.ID(), task: f.Task})
	}
	return out
}

// memoryUsage is a container's cgroup memory usage in bytes.
func memoryUsage(t *testing.T, ctx context.Context, ctr containerd.Container) uint64 {
	t.Helper()
	spec, err := ctr.Spec(ctx)
	if err != nil {
		t.Fatal(err)
	}
	p := spec.Linux.CgroupsPath
	var file string
	if cgroups.Mode() == cgroups.Unified {
		file = filepath.Join("/sys/fs/cgroup", p, "memory.current")
	} else {
		file = filepath.Join("/sys/fs/cgroup/memory", p, "memory.usage_in_bytes")
	}
	b, err := os.ReadFile(file)
	if err != nil {
		t.Fatal(err)
	}
	v, err := strconv.ParseUint(strings.TrimSpace(string(b)), 10, 64)
	if err != nil {
		t.Fatal(err)
	}
	return v
}

func (e *lfEnv) lfClient() *lfclient.Client {
	return lfclient.New(e.Client(), lfclient.WithRoot(e.Root))
}

func (e *lfEnv) logIO() lfclient.ForkOpt {
	return lfclient.WithIO(func(id string) cio.Creator { return cio.LogFile(e.TaskLogPath(id)) })
}

// checkContinues asserts a fork's first tick follows a tick its parent printed.
func checkContinues(t *testing.T, ctx context.Context, parent, fork *counter) int {
	t.Helper()
	first := fork.waitLine(t, ctx, 0, "tick ")
	k, err := strconv.Atoi(strings.TrimPrefix(first, "tick "))
	if err != nil || k < 2 {
		t.Fatalf("%s: first line %q does not continue a count", fork.id, first)
	}
	want := fmt.Sprintf("tick %d", k-1)
	found := false
	for _, l := range parent.lines(t) {
		found = found || l == want
	}
	if !found {
		t.Errorf("%s starts at %q but its parent %s never printed %q", fork.id, first, parent.id, want)
	}
	return k
}

// TestFork10 forks a python container holding 256 MB ten times through the Go
// client: every fork continues the count, its heap verifies, its writes stay its
// own, it costs under 2 MB right after restore, and the parent keeps counting.
func TestFork10(t *testing.T) {
	e, ctx, img := startLFPython(t)
	parent := e.startCounter(t, ctx, img, "par-"+lfRandom(4), 256)
	parentCtr, err := e.Client().LoadContainer(ctx, parent.id)
	if err != nil {
		t.Fatal(err)
	}

	// Shim groups of 4: three fork shims, so killing one shows what the
	// others keep.
	const groupSize = 4
	lf := lfclient.New(e.Client(), lfclient.WithRoot(e.Root), lfclient.WithShimGroupSize(groupSize))
	res, err := lf.Fork(ctx, parent.id, 10, e.logIO())
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("fork: paused %v, checkpoint %v, upper copy %v, 10 restores %v", res.Paused, res.Checkpoint, res.CopyUpper, res.Restore)
	if !res.ThawedBeforeRewrite {
		t.Errorf("the shim did not thaw the parent before the rewrite (paused %v)", res.Paused)
	}
	// Memory right after restore, before anything reads the heap.
	parentMem := memoryUsage(t, ctx, parentCtr)
	var total uint64
	for _, f := range res.Forks {
		m := memoryUsage(t, ctx, f.Container)
		total += m
		t.Logf("fork %s: %d bytes of cgroup memory right after restore", f.Container.ID(), m)
		if m >= 2_000_000 {
			t.Errorf("fork %s uses %d bytes right after restore, want < 2 MB", f.Container.ID(), m)
		}
	}
	if total*10 >= parentMem {
		t.Errorf("10 forks use %d bytes together, parent %d: want < 10%%", total, parentMem)
	}
	t.Logf("memory: parent %d, 10 forks %d (%.2f%%)", parentMem, total, 100*float64(total)/float64(parentMem))

	forks := e.forks(res)
	for _, f := range forks {
		checkContinues(t, ctx, parent, f)
		info, err := f.task.Status(ctx)
		if err != nil || info.Status != containerd.Running {
			t.Errorf("%s: status %v %v", f.id, info.Status, err)
		}
	}
	// One fork writes a page; nobody else may see it.
	w := forks[0].signal(t, ctx, syscall.SIGUSR2, "wrote ")
	t.Logf("%s: %s", forks[0].id, w)
	for i, c := range append(forks, parent) {
		v := c.signal(t, ctx, syscall.SIGUSR1, "verify ")
		want := "verify ok pages=65536 writes=0"
		if i == 0 {
			want = "verify ok pages=65536 writes=1"
		}
		if v != want {
			t.Errorf("%s: %q, want %q", c.id, v, want)
		}
	}
	// The parent kept counting.
	before := parent.lastTick(t)
	parent.waitLine(t, ctx, len(parent.lines(t)), "tick ")
	if parent.lastTick(t) <= before {
		t.Errorf("parent stopped counting at %d", before)
	}
	// The labels name parent, family and snapshot.
	for _, f := range res.Forks {
		l, err := f.Container.Labels(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if l[api.LabelParent] != parent.id || l[api.LabelFamily] != res.Family || l[api.LabelSnapshot] == "" {
			t.Errorf("%s: labels %v", f.Container.ID(), l)
		}
	}
	// Each group's first fork started its shim; the others joined it
	// without containerd running the shim binary (a sandbox named after
	// the leader, only while the call made them), and no record stays.
	checkShimJoins(t, ctx, e, res.Forks, groupSize)
	// The parent has a shim of its own; the forks share shims by groups of
	// at most groupSize, so one dying shim never takes the parent or more
	// than its group.
	shims := shimsByID(e.Address)
	groups := (len(forks) + groupSize - 1) / groupSize
	if len(shims) != 1+groups {
		t.Errorf("%d shim processes serve the parent and 10 forks, want %d", len(shims), 1+groups)
	}
	if _, ok := shims[parent.id]; !ok {
		t.Fatalf("no shim started for the parent %s: %v", parent.id, shims)
	}
	// Kill one fork's shim (as the OOM killer or a crash would): its group
	// dies, the parent and every other fork keep running.
	var victim *counter
	for _, f := range forks {
		if _, ok := shims[f.id]; ok {
			victim = f
			break
		}
	}
	if victim == nil {
		t.Fatalf("no shim started by a fork: %v", shims)
	}
	group := func(c *counter) string {
		spec, err := res.Forks[slices.IndexFunc(forks, func(f *counter) bool { return f == c })].Container.Spec(ctx)
		if err != nil {
			t.Fatal(err)
		}
		return spec.Annotations[api.AnnotationShimGroup]
	}
	victimGroup := group(victim)
	if err := syscall.Kill(shims[victim.id], syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	died := 0
	for _, f := range forks {
		if group(f) == victimGroup {
			died++
			continue
		}
		f.waitLine(t, ctx, len(f.lines(t)), "tick ")
	}
	parent.waitLine(t, ctx, len(parent.lines(t)), "tick ")
	if st, err := parent.task.Status(ctx); err != nil || st.Status != containerd.Running {
		t.Errorf("parent after a fork's shim was killed: %v %v", st.Status, err)
	}
	if died == 0 || died > groupSize {
		t.Errorf("%d forks shared the killed shim, want 1..%d", died, groupSize)
	}
	t.Logf("killed the shim of %s: %d forks of its group went, %d forks and the parent kept running", victim.id, died, len(forks)-died)
}

// checkShimJoins checks that in each shim group of forks (groupSize of them
// in the call's order) every fork after the first joined the first one's
// shim, without a shim start of its own: containerd wrote the sandbox it
// named (the first fork) and the first fork's shim address in its bundle.
// No sandbox record of the call's is left.
func checkShimJoins(t *testing.T, ctx context.Context, e *lfEnv, forks []lfclient.Fork, groupSize int) {
	t.Helper()
	joined := 0
	for i, f := range forks {
		leader := forks[i-i%groupSize].Container.ID()
		id := f.Container.ID()
		sb := e.bundleFile(t, id, "sandbox")
		switch {
		case id == leader && sb != "":
			t.Errorf("group leader %s names a sandbox %q: it should have started its group's shim", id, sb)
		case id != leader && sb != leader:
			t.Errorf("fork %s names sandbox %q, want its group leader %s (it ran a shim start of its own)", id, sb, leader)
		case id != leader:
			var lb, fb struct{ Address string }
			if err := json.Unmarshal([]byte(e.bundleFile(t, leader, "bootstrap.json")), &lb); err != nil {
				t.Fatal(err)
			}
			if err := json.Unmarshal([]byte(e.bundleFile(t, id, "bootstrap.json")), &fb); err != nil {
				t.Fatal(err)
			}
			if fb.Address == "" || fb.Address != lb.Address {
				t.Errorf("fork %s's shim is at %q, its leader %s's at %q", id, fb.Address, leader, lb.Address)
			}
			joined++
		}
		e.noSandboxRecord(t, ctx, id)
	}
	t.Logf("%d of %d forks joined their group leader's shim without a shim start", joined, len(forks))
}

// shimsByID maps the -id of each shim serving the containerd at address (the
// container that started it) to its pid.
func shimsByID(address string) map[string]int {
	out := map[string]int{}
	for _, pid := range harness.ShimPIDs(address) {
		b, err := os.ReadFile(fmt.Sprintf("/proc/%d/cmdline", pid))
		if err != nil {
			continue
		}
		args := strings.Split(string(b), "\x00")
		for i := 0; i+1 < len(args); i++ {
			if args[i] == "-id" {
				out[args[i+1]] = pid
			}
		}
	}
	return out
}

// pyHold is a python program that holds MiB of heap and counts (for tests that
// need no verify protocol).
func pyHold(mib int, extra string) []string {
	prog := fmt.Sprintf("import os,sys,time\n%s\nh=bytearray(%d<<20)\nfor i in range(0,len(h),4096): h[i]=1\nprint('ready',flush=True)\nn=0\nwhile True:\n n+=1\n print('tick %%d'%%n,flush=True)\n time.sleep(0.05)\n", extra, mib)
	return []string{"python3", "-c", prog}
}

// assertNothingLeft checks that nothing remains of the containers ids: no
// container, task, rootfs snapshot, mount, cgroup, bundle, runc state or
// memory-file reference; and that the parent still runs, unpaused.
func (e *lfEnv) assertNothingLeft(t *testing.T, ctx context.Context, parent string, family string, ids []string) {
	t.Helper()
	cl := e.Client()
	ctrs, err := cl.Containers(ctx)
	if err != nil {
		t.Fatal(err)
	}
	for _, c := range ctrs {
		for _, id := range ids {
			if c.ID() == id {
				t.Errorf("container %s left", id)
			}
		}
	}
	sn := cl.SnapshotService("overlayfs")
	for _, id := range ids {
		if _, err := sn.Stat(ctx, id); err == nil {
			t.Errorf("rootfs snapshot %s left", id)
		}
		if _, err := cl.SandboxStore().Get(ctx, id); err == nil {
			t.Errorf("sandbox record %s left (a shim group's join)", id)
		}
		if d := harness.CgroupDirs(e.CgroupPath(id)); len(d) > 0 {
			t.Errorf("cgroups of %s left: %v", id, d)
		}
		if _, err := os.Stat(filepath.Join(e.State, "io.containerd.runtime.v2.task", e.Namespace, id)); err == nil {
			t.Errorf("bundle of %s left", id)
		}
		if _, err := os.Stat(filepath.Join(e.RuncRoot, e.Namespace, id)); err == nil {
			t.Errorf("runc's state of %s left", id)
		}
	}
	mounts, _ := harness.MountsUnder(e.Dir)
	for _, m := range mounts {
		for _, id := range ids {
			if strings.Contains(m, id) {
				t.Errorf("mount %s left", m)
			}
		}
	}
	if family != "" {
		store, err := memfile.OpenStore(filepath.Join(e.Root, "mem"))
		if err != nil {
			t.Fatal(err)
		}
		holders, err := store.Holders(family)
		if err != nil {
			t.Fatal(err)
		}
		for h := range holders {
			for _, id := range ids {
				if strings.HasSuffix(h, "/"+id) {
					t.Errorf("memory-file reference %s left", h)
				}
			}
		}
	}
	task, err := cl.TaskService().Get(ctx, &tasksapi.GetRequest{ContainerID: parent})
	if err != nil {
		t.Fatalf("parent %s: %v", parent, err)
	}
	if st := task.Process.Status.String(); st != "RUNNING" {
		t.Errorf("parent %s is %s, want RUNNING", parent, st)
	}
}

// snapshotsLeft lists the snapshot directories under the LazyFork root.
func (e *lfEnv) snapshotsLeft(t *testing.T) []string {
	t.Helper()
	ents, err := os.ReadDir(filepath.Join(e.Root, "snapshots"))
	if err != nil && !os.IsNotExist(err) {
		t.Fatal(err)
	}
	var out []string
	for _, d := range ents {
		out = append(out, d.Name())
	}
	return out
}

func forkIDs(prefix string, n int) []string {
	ids := make([]string, n)
	for i := range ids {
		ids[i] = fmt.Sprintf("%s-%d", prefix, i)
	}
	return ids
}

// TestForkFailures: a CRIU error, missing memory files, bad snapshot dirs. Each
// returns a clear error, the parent keeps running unpaused, nothing is left.
func TestForkFailures(t *testing.T) {
	e, ctx, img := startLFPython(t)
	lf := e.lfClient()

	t.Run("criu-error", func(t *testing.T) {
		// An unlinked open file bigger than CRIU's ghost limit cannot be dumped.
		id := "ghost-" + lfRandom(4)
		ghost := "f=open('/tmp/g','wb'); f.write(b'x'*(3<<20)); f.flush(); os.unlink('/tmp/g')"
		_, task := e.run(t, ctx, img, id, pyHold(16, ghost))
		c := &counter{e: e, id: id, task: task}
		c.waitLine(t, ctx, 0, "tick 2")
		ids := forkIDs("gf-"+lfRandom(3), 2)
		_, err := lf.Fork(ctx, id, 2, lfclient.WithIDs(ids...))
		if err == nil {
			t.Fatal("fork of a container with a big ghost file succeeded")
		}
		t.Logf("error: %v", err)
		if !strings.Contains(err.Error(), "checkpoint") || !strings.Contains(strings.ToLower(err.Error()), "criu") {
			t.Errorf("error does not say the CRIU checkpoint failed: %v", err)
		}
		e.assertNothingLeft(t, ctx, id, id, ids)
		if s := e.snapshotsLeft(t); len(s) > 0 {
			t.Errorf("snapshot dirs left: %v", s)
		}
		// The parent still counts.
		before := c.lastTick(t)
		c.waitLine(t, ctx, len(c.lines(t)), "tick ")
		if c.lastTick(t) <= before {
			t.Error("parent stopped counting")
		}
	})

	// A healthy parent and a kept snapshot for the restore failures.
	id := "hp-" + lfRandom(4)
	_, task := e.run(t, ctx, img, id, pyHold(32, ""))
	(&counter{e: e, id: id, task: task}).waitLine(t, ctx, 0, "tick 2")
	res, err := lf.Fork(ctx, id, 1, lfclient.KeepSnapshot())
	if err != nil {
		t.Fatal(err)
	}
	for _, f := range res.Forks {
		if _, err := f.Task.Delete(ctx, containerd.WithProcessKill); err != nil {
			t.Fatal(err)
		}
		if err := f.Container.Delete(ctx, containerd.WithSnapshotCleanup); err != nil {
			t.Fatal(err)
		}
	}
	snap, err := memfile.ReadSnapshot(res.Snapshot)
	if err != nil {
		t.Fatal(err)
	}
	store, err := memfile.OpenStore(filepath.Join(e.Root, "mem"))
	if err != nil {
		t.Fatal(err)
	}
	famDir, err := store.FamilyDir(snap.Family)
	if err != nil {
		t.Fatal(err)
	}
	// copySnapshot copies the kept snapshot to a new dir for corrupting.
	copySnapshot := func(t *testing.T) string {
		dst := filepath.Join(e.Root, "snapshots", "bad-"+lfRandom(4))
		if out, err := exec.Command("cp", "-a", filepath.Dir(res.Snapshot), dst).CombinedOutput(); err != nil {
			t.Fatalf("cp: %v %s", err, out)
		}
		t.Cleanup(func() { os.RemoveAll(dst) })
		return filepath.Join(dst, "image")
	}

	t.Run("corrupt-image", func(t *testing.T) {
		// The shim accepts the snapshot; runc's restore fails at Start and
		// leaves a CREATED task with pid 0, which must go entirely.
		bad := copySnapshot(t)
		cores, _ := filepath.Glob(filepath.Join(bad, "core-*.img"))
		for _, c := range cores {
			os.Remove(c)
		}
		ids := forkIDs("ci-"+lfRandom(3), 2)
		_, err := lf.RestoreForks(ctx, id, bad, 2, lfclient.WithIDs(ids...))
		if err == nil {
			t.Fatal("restore from a snapshot without core images succeeded")
		}
		t.Logf("error: %v", err)
		if !strings.Contains(err.Error(), "restore") {
			t.Errorf("error does not say the restore failed: %v", err)
		}
		e.assertNothingLeft(t, ctx, id, snap.Family, ids)
	})

	t.Run("bad-snapshot-file", func(t *testing.T) {
		// A garbled lazyfork.json: the shim refuses the create, clearly.
		bad := copySnapshot(t)
		if err := os.WriteFile(filepath.Join(bad, memfile.SnapshotFile), []byte("{garbage"), 0o600); err != nil {
			t.Fatal(err)
		}
		parent, err := e.Client().LoadContainer(ctx, id)
		if err != nil {
			t.Fatal(err)
		}
		fid := "bs-" + lfRandom(4)
		ctr, err := e.CloneContainer(ctx, parent, fid)
		if err != nil {
			t.Fatal(err)
		}
		_, err = e.NewTask(ctx, ctr, containerd.WithRestoreImagePath(bad))
		if err == nil {
			t.Fatal("task from a garbled snapshot was created")
		}
		t.Logf("error: %v", err)
		if !strings.Contains(err.Error(), "snapshot") {
			t.Errorf("error does not name the snapshot: %v", err)
		}
		if err := ctr.Delete(ctx, containerd.WithSnapshotCleanup); err != nil {
			t.Fatal(err)
		}
		e.assertNothingLeft(t, ctx, id, snap.Family, []string{fid})
	})

	t.Run("missing-memory-files", func(t *testing.T) {
		bad := copySnapshot(t)
		// A memory file vanishes (an administrator, a bug): forks from the
		// snapshot must fail before CRIU runs, and say which file.
		for _, f := range snap.Files {
			// Memory files are immutable: only an explicit unseal lets
			// anyone move one.
			if err := memfile.Unseal(filepath.Join(famDir, f)); err != nil {
				t.Fatal(err)
			}
			if err := os.Rename(filepath.Join(famDir, f), filepath.Join(famDir, "gone-"+f+".x")); err != nil {
				t.Fatal(err)
			}
			defer memfile.Seal(filepath.Join(famDir, f))
			defer os.Rename(filepath.Join(famDir, "gone-"+f+".x"), filepath.Join(famDir, f))
		}
		ids := forkIDs("mf-"+lfRandom(3), 2)
		_, err := lf.RestoreForks(ctx, id, bad, 2, lfclient.WithIDs(ids...))
		if err == nil {
			t.Fatal("restore without memory files succeeded")
		}
		t.Logf("error: %v", err)
		if !strings.Contains(err.Error(), "memory file") {
			t.Errorf("error does not name the missing memory file: %v", err)
		}
		e.assertNothingLeft(t, ctx, id, snap.Family, ids)
	})

	if err := lf.RemoveSnapshot(ctx, res.Snapshot); err != nil {
		t.Fatal(err)
	}
	// The family's files are freed but the one the running parent was
	// moved onto: no fork and no snapshot holds them. The parent holds its
	// family (its own reference, with no files) and its moved file.
	time.Sleep(100 * time.Millisecond)
	holders, err := store.Holders(snap.Family)
	if err != nil {
		t.Fatal(err)
	}
	parentFiles := map[string]bool{}
	for h, files := range holders {
		own := h == memfile.HolderContainer+e.Namespace+"/"+id && len(files) == 0
		if !own && !strings.HasPrefix(h, "moved:"+e.Namespace+"/"+id+"/") {
			t.Errorf("holder %s left after the forks and snapshots went: %v", h, files)
		}
		for _, f := range files {
			parentFiles[f] = true
		}
	}
	left, _ := filepath.Glob(filepath.Join(famDir, "*"+memfile.FileExt))
	for _, f := range left {
		if !parentFiles[filepath.Base(f)] {
			t.Errorf("memory file %s left after its last holder went", f)
		}
	}
}

// TestCtrFlows: a LazyFork container made with `ctr run`, checkpointed with
// `ctr tasks checkpoint --image-path`, forked from that directory, and its fork
// driven with ctr (ls, exec, pause, resume, metrics, kill, delete); then the
// lazyfork CLI forks it, the parent is deleted, and the forks keep running.
func TestCtrFlows(t *testing.T) {
	e := startLF(t, harness.Options{})
	ctx := e.ctx(t)
	if _, err := e.ImportImage(ctx, "python"); err != nil {
		t.Fatal(err)
	}
	id := "ctr-" + lfRandom(4)
	logPath := e.TaskLogPath(id)
	args := append([]string{"run", "-d", "--runtime", lfRuntime, "--runc-root", e.RuncRoot,
		"--cgroup", e.CgroupPath(id), "--log-uri", "file://" + logPath, harness.PythonImage, id}, pyHold(32, "")...)
	e.ctr(t, args...)
	parent := &counter{e: e, id: id}
	parent.waitLine(t, ctx, 0, "tick 3")
	if st := e.taskStatus(t, id); st != "RUNNING" {
		t.Fatalf("ctr tasks ls: %s is %q", id, st)
	}

	dir := filepath.Join(e.Dir, "ckpt-"+id)
	e.ctr(t, "tasks", "checkpoint", "--image-path", dir, id)
	snap, err := memfile.ReadSnapshot(dir)
	if err != nil {
		t.Fatalf("ctr tasks checkpoint --image-path did not leave a LazyFork snapshot: %v", err)
	}
	if snap.Family != id {
		t.Errorf("snapshot family %q, want %q", snap.Family, id)
	}
	pages, _ := filepath.Glob(filepath.Join(dir, "pages-*.img"))
	var size int64
	for _, p := range pages {
		if st, err := os.Stat(p); err == nil {
			size += st.Size()
		}
	}
	if size > 8<<20 {
		t.Errorf("snapshot keeps %d bytes of pages for a 32 MiB heap", size)
	}
	if st := e.taskStatus(t, id); st != "RUNNING" {
		t.Errorf("after checkpoint the parent is %q", st)
	}

	// A fork restored from the directory ctr wrote.
	parentCtr, err := e.Client().LoadContainer(ctx, id)
	if err != nil {
		t.Fatal(err)
	}
	fid := "cf-" + lfRandom(4)
	fctr, err := e.CloneContainer(ctx, parentCtr, fid)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := e.StartTask(ctx, fctr, containerd.WithRestoreImagePath(dir)); err != nil {
		t.Fatal(err)
	}
	fork := &counter{e: e, id: fid}
	checkContinues(t, ctx, parent, fork)

	out := e.ctr(t, "tasks", "ls")
	if !strings.Contains(out, fid) || !strings.Contains(out, id) {
		t.Errorf("ctr tasks ls does not list parent and fork:\n%s", out)
	}
	if got := strings.TrimSpace(e.ctr(t, "tasks", "exec", "--exec-id", "oc", fid, "cat", "/proc/sys/vm/overcommit_memory")); got != "2" {
		t.Errorf("exec in the fork: overcommit %q", got)
	}
	e.ctr(t, "tasks", "pause", fid)
	if st := e.taskStatus(t, fid); st != "PAUSED" {
		t.Errorf("after pause: %q", st)
	}
	e.ctr(t, "tasks", "resume", fid)
	if st := e.taskStatus(t, fid); st != "RUNNING" {
		t.Errorf("after resume: %q", st)
	}
	skip := len(fork.lines(t))
	fork.waitLine(t, ctx, skip, "tick ")
	if m := e.ctr(t, "tasks", "metrics", fid); !strings.Contains(m, "memory") {
		t.Errorf("ctr tasks metrics of the fork:\n%s", m)
	}
	e.ctr(t, "tasks", "kill", "-s", "SIGKILL", fid)
	deadline := time.Now().Add(30 * time.Second)
	for e.taskStatus(t, fid) != "STOPPED" && time.Now().Before(deadline) {
		time.Sleep(50 * time.Millisecond)
	}
	e.ctr(t, "tasks", "delete", fid)
	e.ctr(t, "containers", "delete", fid)
	if strings.Contains(e.ctr(t, "containers", "ls"), fid) {
		t.Errorf("fork container still listed")
	}

	// The lazyfork CLI; then the parent goes and its forks stay.
	cli := exec.Command(filepath.Join(e.Bin, "lazyfork"), "--address", e.Address, "--namespace", e.Namespace,
		"--root", e.Root, "fork", id, "--count", "2")
	b, err := cli.CombinedOutput()
	if err != nil {
		t.Fatalf("lazyfork fork: %v\n%s", err, b)
	}
	ids := strings.Fields(string(b))
	if len(ids) != 2 {
		t.Fatalf("lazyfork fork printed %q, want two ids", b)
	}
	for _, f := range ids {
		if st := e.taskStatus(t, f); st != "RUNNING" {
			t.Errorf("CLI fork %s is %q", f, st)
		}
	}
	// lazyfork mem reports the family's files, holders and the memory cgroup
	// they are charged to.
	mb, err := exec.Command(filepath.Join(e.Bin, "lazyfork"), "--root", e.Root, "mem").CombinedOutput()
	if err != nil {
		t.Fatalf("lazyfork mem: %v\n%s", err, mb)
	}
	found := false
	for _, l := range strings.Split(string(mb), "\n") {
		// FAMILY FILES SIZE HOLDERS CGROUP, the size human ("35.6 MiB").
		f := strings.Fields(l)
		if len(f) >= 5 && f[0] == id {
			found = f[1] != "0" && f[2] != "0" && f[len(f)-2] != "0" && strings.HasPrefix(f[len(f)-1], "/")
		}
	}
	if !found {
		t.Errorf("lazyfork mem does not report family %s with files, holders and a cgroup:\n%s", id, mb)
	}
	e.ctr(t, "tasks", "kill", "-s", "SIGKILL", id)
	deadline = time.Now().Add(30 * time.Second)
	for e.taskStatus(t, id) != "STOPPED" && time.Now().Before(deadline) {
		time.Sleep(50 * time.Millisecond)
	}
	e.ctr(t, "tasks", "delete", id)
	e.ctr(t, "containers", "delete", id)
	time.Sleep(500 * time.Millisecond)
	for _, f := range ids {
		if st := e.taskStatus(t, f); st != "RUNNING" {
			t.Errorf("after the parent was deleted, fork %s is %q", f, st)
		}
		if got := strings.TrimSpace(e.ctr(t, "tasks", "exec", "--exec-id", "alive", f, "python3", "-c", "print(6*7)")); got != "42" {
			t.Errorf("exec in %s after its parent went: %q", f, got)
		}
	}
}

// TestForkOfFork forks a fork of a fork, nine levels deep, each level writing
// a page of its own first; every level verifies its heap (the markers it
// inherited and its own). Then the root is deleted and the forks keep running.
func TestForkOfFork(t *testing.T) {
	e, ctx, img := startLFPython(t)
	lf := e.lfClient()
	root := e.startCounter(t, ctx, img, "deep-"+lfRandom(4), 64)
	chain := []*counter{root}
	for level := 1; level <= 9; level++ {
		prev := chain[len(chain)-1]
		prev.signal(t, ctx, syscall.SIGUSR2, "wrote ")
		res, err := lf.Fork(ctx, prev.id, 1, e.logIO())
		if err != nil {
			t.Fatalf("level %d: %v", level, err)
		}
		f := e.forks(res)[0]
		checkContinues(t, ctx, prev, f)
		t.Logf("level %d: %s (paused %v, checkpoint %v, restore %v)", level, f.id, res.Paused, res.Checkpoint, res.Forks[0].Restore)
		if !res.ThawedBeforeRewrite {
			t.Errorf("level %d: the shim did not thaw %s before the rewrite", level, prev.id)
		}
		l, err := res.Forks[0].Container.Labels(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if l[api.LabelParent] != prev.id || l[api.LabelFamily] != root.id {
			t.Errorf("level %d labels %v", level, l)
		}
		chain = append(chain, f)
	}
	// A parent its user paused is forked and stays paused until resumed.
	deepest := chain[9]
	if err := deepest.task.Pause(ctx); err != nil {
		t.Fatal(err)
	}
	res, err := lf.Fork(ctx, deepest.id, 1, e.logIO())
	if err != nil {
		t.Fatalf("fork of a paused fork: %v", err)
	}
	if st, err := deepest.task.Status(ctx); err != nil || st.Status != containerd.Paused || res.ThawedBeforeRewrite {
		t.Errorf("a paused parent after its fork: %v (%v), thawed before rewrite %v; want still paused", st.Status, err, res.ThawedBeforeRewrite)
	}
	checkContinues(t, ctx, deepest, e.forks(res)[0])
	if err := deepest.task.Resume(ctx); err != nil {
		t.Fatal(err)
	}
	for i, c := range chain {
		want := fmt.Sprintf("verify ok pages=16384 writes=%d", min(i+1, 9))
		if i == 9 {
			want = "verify ok pages=16384 writes=9"
		}
		if v := c.signal(t, ctx, syscall.SIGUSR1, "verify "); v != want {
			t.Errorf("level %d (%s): %q, want %q", i, c.id, v, want)
		}
	}

	// Delete the root: its forks keep running and keep their memory.
	rootCtr, err := e.Client().LoadContainer(ctx, root.id)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := root.task.Delete(ctx, containerd.WithProcessKill); err != nil {
		t.Fatal(err)
	}
	if err := rootCtr.Delete(ctx, containerd.WithSnapshotCleanup); err != nil {
		t.Fatal(err)
	}
	for i, c := range chain[1:] {
		st, err := c.task.Status(ctx)
		if err != nil || st.Status != containerd.Running {
			t.Errorf("level %d after the root went: %v %v", i+1, st.Status, err)
		}
		c.waitLine(t, ctx, len(c.lines(t)), "tick ")
	}
	if v := deepest.signal(t, ctx, syscall.SIGUSR1, "verify "); v != "verify ok pages=16384 writes=9" {
		t.Errorf("deepest fork after the root went: %q", v)
	}
	store, err := memfile.OpenStore(filepath.Join(e.Root, "mem"))
	if err != nil {
		t.Fatal(err)
	}
	holders, err := store.Holders(root.id)
	if err != nil {
		t.Fatal(err)
	}
	n := 0
	for h := range holders {
		if strings.HasPrefix(h, "container:") {
			n++
		}
	}
	if n != 10 {
		t.Errorf("%d containers hold the family's files, want 10 (nine levels and the paused one's fork): %v", n, holders)
	}
}

// TestForkOOM: runc's shim watches only the tasks it creates for OOM; a
// restored fork must report its OOM kills too.
func TestForkOOM(t *testing.T) {
	e, ctx, img := startLFPython(t)
	id := "oom-" + lfRandom(4)
	_, task := e.run(t, ctx, img, id, pyHold(16, ""), oci.WithMemoryLimit(96<<20))
	(&counter{e: e, id: id, task: task}).waitLine(t, ctx, 0, "tick 2")
	res, err := e.lfClient().Fork(ctx, id, 1, e.logIO())
	if err != nil {
		t.Fatal(err)
	}
	fork := res.Forks[0]
	evctx, cancel := context.WithTimeout(ctx, time.Minute)
	defer cancel()
	events, errs := e.Client().EventService().Subscribe(evctx, `topic=="/tasks/oom"`)
	// A process in the fork that outgrows the limit is OOM-killed.
	out, code, err := e.execOut(ctx, fork.Task, "python3", "-c", "b = bytearray(512 << 20)")
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("hog exited %d: %s", code, strings.TrimSpace(out))
	for {
		select {
		case env := <-events:
			v, err := typeurl.UnmarshalAny(env.Event)
			if err != nil {
				t.Fatal(err)
			}
			if ev, ok := v.(*eventstypes.TaskOOM); ok && ev.ContainerID == fork.Container.ID() {
				return
			}
		case err := <-errs:
			t.Fatalf("no OOM event for the fork: %v", err)
		}
	}
}

// startSnapshotter runs lazyfork-snapshotter for a test; call it before
// startLF so that it outlives containerd's teardown.
func startSnapshotter(t *testing.T, bin string) (root, address string) {
	t.Helper()
	dir, err := os.MkdirTemp("", "lfsn-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) }) // after runSnapshotter's cleanup
	root, address = filepath.Join(dir, "root"), filepath.Join(dir, "sn.sock")
	runSnapshotter(t, bin, filepath.Join(dir, "snapshotter.log"), dir, func() error {
		c, err := snapclient.Dial(context.Background(), snapclient.TTRPCAddress(address))
		if err == nil {
			c.Close()
		}
		return err
	}, "--root", root, "--address", address, "--lazyfork-root", filepath.Join(dir, "lazyfork")) // never the host's
	return root, address
}

// TestForkOnFrozenLayer: a parent on LazyFork's snapshotter; its forks stack a
// fresh upper on one frozen layer of its writable layer (no copy per fork), see
// the parent's files, continue its count, and keep their own writes.
func TestForkOnFrozenLayer(t *testing.T) {
	testutil.RequiresRoot(t)
	bin := lfBin(t)
	snRoot, snAddr := startSnapshotter(t, bin)
	t.Setenv("LAZYFORK_BIN", bin)
	e := startLF(t, harness.Options{ProxyPlugins: []harness.ProxyPlugin{{
		Name: snapclient.SnapshotterName, Type: "snapshot", Address: snAddr, ExportsRoot: snRoot,
	}}})
	ctx := e.ctx(t)
	img, err := e.ImportImage(ctx, "python", harness.WithSnapshotter(snapclient.SnapshotterName))
	if err != nil {
		t.Fatal(err)
	}
	id := "fz-" + lfRandom(4)
	ctr, err := e.NewContainer(ctx, id, harness.ContainerConfig{
		Image: img, Runtime: lfRuntime, Snapshotter: snapclient.SnapshotterName,
		Args: []string{"sh", "-c", "echo from-parent > /marker && exec python3 " + counterPy + " 32 --interval 0.05"},
	})
	if err != nil {
		t.Fatal(err)
	}
	task, err := e.StartTask(ctx, ctr)
	if err != nil {
		t.Fatal(err)
	}
	parent := &counter{e: e, id: id, task: task}
	parent.waitLine(t, ctx, 0, "tick 3")
	res, err := e.lfClient().Fork(ctx, id, 3, e.logIO())
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("paused %v (freeze commit %v), 3 restores %v", res.Paused, res.CopyUpper, res.Restore)
	sn := e.Client().SnapshotService(snapclient.SnapshotterName)
	for _, f := range e.forks(res) {
		checkContinues(t, ctx, parent, f)
		info, err := sn.Stat(ctx, f.id)
		if err != nil {
			t.Fatal(err)
		}
		if !strings.HasPrefix(info.Parent, "lazyfork-frozen-") {
			t.Errorf("fork %s rootfs stacks on %q, not on a frozen layer", f.id, info.Parent)
		}
		if out, _, err := e.execOut(ctx, f.task, "sh", "-c", "cat /marker; echo mine > /mine"); err != nil || strings.TrimSpace(out) != "from-parent" {
			t.Errorf("fork %s sees %q (%v), want the parent's file", f.id, out, err)
		}
	}
	if out, _, err := e.execOut(ctx, task, "sh", "-c", "cat /mine 2>&1 || true"); err != nil || strings.Contains(out, "mine") && !strings.Contains(out, "No such") {
		t.Errorf("a fork's write reached the parent: %q %v", out, err)
	}

	// For a fork whose rootfs someone else prepared (a pod's): the frozen
	// layer's own files are copied into the given upper directory, and the
	// layer is let go.
	upper := t.TempDir()
	image, err := e.lfClient().SnapshotForRootfs(ctx, id, upper)
	if err != nil {
		t.Fatalf("SnapshotForRootfs: %v", err)
	}
	if b, err := os.ReadFile(filepath.Join(upper, "marker")); err != nil || strings.TrimSpace(string(b)) != "from-parent" {
		t.Errorf("upper directory after SnapshotForRootfs: marker %q (%v), want the parent's", b, err)
	}
	if _, err := memfile.ReadSnapshot(image); err != nil {
		t.Errorf("SnapshotForRootfs returned %s: %v", image, err)
	}
	if err := e.lfClient().RemoveSnapshot(ctx, image); err != nil {
		t.Errorf("RemoveSnapshot: %v", err)
	}
}
