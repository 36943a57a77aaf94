package integration

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"sort"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	tasksapi "github.com/containerd/containerd/api/services/tasks/v1"
	"github.com/containerd/containerd/v2/core/snapshots"

	"github.com/lazyfork/lazyfork/api"
	"github.com/lazyfork/lazyfork/integration/harness"
	"github.com/lazyfork/lazyfork/memfile"
	snapclient "github.com/lazyfork/lazyfork/snapshotter/client"
)

// stackState is what a user checks is back as before: containers, leases,
// snapshots of both snapshotters, LazyFork's files and their bytes.
type stackState struct {
	containers, leases, snapshots, files []string
	// sandboxes are containerd's sandbox records (a fork call's shim
	// groups' joins, client/shimjoin.go).
	sandboxes []string
	bytes     int64
}

func (e *cliEnv) state(t *testing.T) stackState {
	t.Helper()
	ctx := e.ctx(t)
	cl := e.Client()
	var s stackState
	ctrs, err := cl.ContainerService().List(ctx)
	if err != nil {
		t.Fatal(err)
	}
	for _, c := range ctrs {
		s.containers = append(s.containers, c.ID)
	}
	sbs, err := cl.SandboxStore().List(ctx)
	if err != nil {
		t.Fatal(err)
	}
	for _, sb := range sbs {
		s.sandboxes = append(s.sandboxes, sb.ID)
	}
	ls, err := cl.LeasesService().List(ctx)
	if err != nil {
		t.Fatal(err)
	}
	for _, l := range ls {
		s.leases = append(s.leases, l.ID)
	}
	for _, name := range []string{snapclient.SnapshotterName, "overlayfs"} {
		err := cl.SnapshotService(name).Walk(ctx, func(_ context.Context, i snapshots.Info) error {
			s.snapshots = append(s.snapshots, name+":"+i.Name)
			return nil
		})
		if err != nil {
			t.Fatal(err)
		}
	}
	held := e.heldFiles(t, s.containers)
	_ = filepath.WalkDir(e.Root, func(p string, d fs.DirEntry, err error) error {
		if err != nil || d.IsDir() {
			return nil
		}
		rel, _ := filepath.Rel(e.Root, p)
		if strings.HasPrefix(rel, "locks/") { // empty lock files, one per parent
			return nil
		}
		// Memory files existing containers hold (a parent's own: the file
		// it moved onto, the patches of what it wrote since), with their
		// view links, charge records and references: their state, freed
		// with them, not a leftover of the fork call.
		if held[filepath.Base(p)] || e.containerRef(p, s.containers) {
			return nil
		}
		s.files = append(s.files, rel)
		var st syscall.Stat_t
		if syscall.Stat(p, &st) == nil {
			s.bytes += st.Blocks * 512
		}
		return nil
	})
	for _, l := range [][]string{s.containers, s.leases, s.snapshots, s.files, s.sandboxes} {
		sort.Strings(l)
	}
	return s
}

// heldFiles are the memory files that existing containers hold (their
// snapshots' files, or the files they were moved onto).
func (e *cliEnv) heldFiles(t *testing.T, containers []string) map[string]bool {
	t.Helper()
	exists := map[string]bool{}
	for _, c := range containers {
		exists[c] = true
	}
	out := map[string]bool{}
	ents, _ := os.ReadDir(filepath.Join(e.Root, "mem"))
	store, err := memfile.OpenStore(filepath.Join(e.Root, "mem"))
	if err != nil {
		t.Fatal(err)
	}
	for _, fam := range ents {
		if !fam.IsDir() || strings.HasPrefix(fam.Name(), ".") {
			continue
		}
		holders, _ := store.Holders(fam.Name())
		for h, files := range holders {
			if id := containerOfHolder(h, e.Namespace); id != "" && exists[id] {
				for _, f := range files {
					out[f] = true
				}
			}
		}
	}
	return out
}

// containerOfHolder is the container id of a container's holder
// ("container:NS/ID", "moved:NS/ID/FILE" or the patches its next snapshot
// reuses, "patches:NS/ID/FILE") in namespace ns, "" otherwise.
func containerOfHolder(h, ns string) string {
	for _, p := range []string{"container:" + ns + "/", "moved:" + ns + "/", "patches:" + ns + "/"} {
		if rest, ok := strings.CutPrefix(h, p); ok {
			id, _, _ := strings.Cut(rest, "/")
			return id
		}
	}
	return ""
}

// containerRef reports whether p is the reference record of an existing
// container's holder.
func (e *cliEnv) containerRef(p string, containers []string) bool {
	if !strings.Contains(p, "/refs/") {
		return false
	}
	b, err := os.ReadFile(p)
	if err != nil {
		return false
	}
	var rec struct {
		Holder string `json:"holder"`
	}
	if json.Unmarshal(b, &rec) != nil {
		return false
	}
	id := containerOfHolder(rec.Holder, e.Namespace)
	return id != "" && slices.Contains(containers, id)
}

// assertSame checks that nothing is left beyond the before state (what was
// there may have gone: containerd collects a deleted fork's frozen layer).
func assertSame(t *testing.T, before, after stackState) {
	t.Helper()
	for _, l := range leftovers(before, after) {
		t.Error(l)
	}
}

// leftovers lists what after holds that before did not.
func leftovers(before, after stackState) []string {
	var left []string
	for _, c := range []struct {
		what string
		b, a []string
	}{{"containers", before.containers, after.containers}, {"leases", before.leases, after.leases},
		{"snapshots", before.snapshots, after.snapshots}, {"files under the LazyFork root", before.files, after.files},
		{"sandbox records", before.sandboxes, after.sandboxes}} {
		was := map[string]bool{}
		for _, x := range c.b {
			was[x] = true
		}
		for _, x := range c.a {
			if !was[x] {
				left = append(left, fmt.Sprintf("%s: %s left (before: %q)", c.what, x, c.b))
			}
		}
	}
	if after.bytes > before.bytes+64<<10 {
		left = append(left, fmt.Sprintf("the LazyFork root holds %d bytes, %d before", after.bytes, before.bytes))
	}
	return left
}

// assertSettles is assertSame for a state containerd cleans up after on its
// own time: the tasks of a shim that was killed are deleted (and LazyFork's
// `delete` subcommand releases their memory files and views) when containerd
// notices the lost connection, which under load can come after the fork call
// and gc return. It runs gc and compares until the state is as before, or a
// deadline passes.
func (e *cliEnv) assertSettles(t *testing.T, before stackState) {
	t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	for {
		e.must(t, "gc")
		after := e.state(t)
		if len(leftovers(before, after)) == 0 || time.Now().After(deadline) {
			assertSame(t, before, after)
			return
		}
		time.Sleep(500 * time.Millisecond)
	}
}

// parentRuns checks the parent's task is RUNNING (not paused) and still counting.
func (e *cliEnv) parentRuns(t *testing.T, id string) {
	t.Helper()
	task, err := e.Client().TaskService().Get(e.ctx(t), &tasksapi.GetRequest{ContainerID: id})
	if err != nil {
		t.Fatalf("parent %s: %v", id, err)
	}
	if st := task.Process.Status.String(); st != "RUNNING" {
		t.Fatalf("parent %s is %s, want RUNNING", id, st)
	}
	last := e.waitTick(t, id, 0)
	e.waitTick(t, id, last)
}

// startCounterCLI creates a counter with the CLI, forks and deletes it once
// (so that the family's records exist), and returns the stack's state then.
func (e *cliEnv) startCounterCLI(t *testing.T, name string) stackState {
	t.Helper()
	ctx := e.ctx(t)
	if _, err := e.ImportImage(ctx, "python", harness.WithSnapshotter(snapclient.SnapshotterName)); err != nil {
		t.Fatal(err)
	}
	pyRef, _ := harness.ImageRef("python")
	e.must(t, "create", "--name", name, pyRef, "--", "python3", counterPy, "16", "--interval", "0.05")
	e.waitTick(t, name, 3)
	warm := strings.TrimSpace(e.must(t, "fork", name))
	e.must(t, "delete", "-f", warm)
	return e.state(t)
}

// failingFork is `lazyfork fork` stopped at a failpoint.
type failingFork struct {
	cmd            *exec.Cmd
	stdout, stderr bytes.Buffer
	done           chan error
}

// forkAt runs `lazyfork fork ARGS` with LAZYFORK_FAILPOINT=stage:sleep=10m and
// returns once it reached the failpoint.
func (e *cliEnv) forkAt(t *testing.T, stage string, args ...string) *failingFork {
	t.Helper()
	full := append([]string{"--address", e.Address, "--namespace", e.Namespace, "--root", e.Root, "--log-dir", e.logDir, "fork"}, args...)
	f := &failingFork{cmd: exec.Command(filepath.Join(e.Bin, "lazyfork"), full...), done: make(chan error, 1)}
	f.cmd.Env = append(os.Environ(), "LAZYFORK_FAILPOINT="+stage+":sleep=10m")
	f.cmd.Stdout = &f.stdout
	pr, pw := io.Pipe()
	f.cmd.Stderr = pw
	if err := f.cmd.Start(); err != nil {
		t.Fatal(err)
	}
	reached := make(chan struct{})
	scanned := make(chan struct{})
	var mu sync.Mutex
	go func() {
		defer close(scanned)
		sc := bufio.NewScanner(pr)
		for sc.Scan() {
			mu.Lock()
			f.stderr.WriteString(sc.Text() + "\n")
			mu.Unlock()
			if sc.Text() == "lazyfork: failpoint "+stage {
				close(reached)
			}
		}
	}()
	go func() {
		err := f.cmd.Wait()
		pw.Close()
		<-scanned // every line of stderr is in f.stderr before done
		f.done <- err
	}()
	select {
	case <-reached:
		return f
	case err := <-f.done:
		mu.Lock()
		defer mu.Unlock()
		t.Fatalf("lazyfork fork ended (%v) before failpoint %s:\n%s", err, stage, f.stderr.String())
	case <-time.After(3 * time.Minute):
		_ = f.cmd.Process.Kill()
		t.Fatalf("lazyfork fork did not reach failpoint %s", stage)
	}
	return nil
}

func (f *failingFork) wait(t *testing.T) error {
	t.Helper()
	select {
	case err := <-f.done:
		return err
	case <-time.After(3 * time.Minute):
		_ = f.cmd.Process.Kill()
		t.Fatal("lazyfork fork does not end")
		return nil
	}
}

var crashStages = []string{"after-pause", "after-freeze", "after-checkpoint", "after-first-fork-created", "before-resume"}

// TestCrashCLIKilled: the CLI SIGKILLed at each stage of a fork; lazyfork gc
// thaws the parent and removes everything the fork made.
func TestCrashCLIKilled(t *testing.T) {
	e := startCLIEnv(t)
	before := e.startCounterCLI(t, "counter")
	for _, stage := range crashStages {
		t.Run(stage, func(t *testing.T) {
			f := e.forkAt(t, stage, "counter", "--count", "2")
			_ = f.cmd.Process.Kill()
			_ = f.wait(t)
			out := e.must(t, "gc")
			t.Logf("gc after a kill at %s:\n%s", stage, out)
			if !strings.Contains(out, "removed op record") {
				t.Errorf("gc removed no operation record:\n%s", out)
			}
			e.parentRuns(t, "counter")
			assertSame(t, before, e.state(t))
		})
	}
	// A fork after all that works.
	id := strings.TrimSpace(e.must(t, "fork", "counter"))
	e.waitTick(t, id, 0)
}

// TestCrashCLIKilledJoining: a fork of a stopped container restores its kept
// snapshot, joining the shim of a fork of it that runs (client/shimjoin.go);
// the CLI SIGKILLed there leaves the join's sandbox record, named after that
// other fork, and lazyfork gc removes it with the rest; the running fork is
// untouched.
func TestCrashCLIKilledJoining(t *testing.T) {
	e := startCLIEnv(t)
	e.startCounterCLI(t, "counter")
	e.must(t, "stop", "counter")
	first := strings.TrimSpace(e.must(t, "fork", "counter"))
	e.waitTick(t, first, 0)
	before := e.state(t)
	f := e.forkAt(t, "after-first-fork-created", "counter", "--count", "2")
	sbs, err := e.Client().SandboxStore().List(e.ctx(t))
	if err != nil {
		t.Fatal(err)
	}
	if len(sbs) != 1 || sbs[0].ID != first {
		var ids []string
		for _, sb := range sbs {
			ids = append(ids, sb.ID)
		}
		t.Errorf("sandbox records during the call: %v, want one named after the running fork %s", ids, first)
	}
	_ = f.cmd.Process.Kill()
	_ = f.wait(t)
	out := e.must(t, "gc")
	t.Logf("gc:\n%s", out)
	if !strings.Contains(out, "removed sandbox record") {
		t.Errorf("gc removed no sandbox record:\n%s", out)
	}
	assertSame(t, before, e.state(t))
	e.waitTick(t, first, e.waitTick(t, first, 0))
	// The stopped container's snapshot and its frozen layer go with it.
	e.must(t, "delete", "-f", first)
	e.must(t, "delete", "-f", "counter")
}

// TestCrashCLIInterrupted: SIGINT (Ctrl-C) and SIGTERM at a stage cancel the
// fork; it cleans up by itself, prints no id, and the parent runs on.
func TestCrashCLIInterrupted(t *testing.T) {
	e := startCLIEnv(t)
	before := e.startCounterCLI(t, "counter")
	for i, stage := range crashStages {
		sig := os.Interrupt
		if i%2 == 1 {
			sig = syscall.SIGTERM
		}
		t.Run(stage, func(t *testing.T) {
			f := e.forkAt(t, stage, "counter", "--count", "2")
			_ = f.cmd.Process.Signal(sig)
			err := f.wait(t)
			if err == nil {
				t.Errorf("interrupted fork exited 0")
			}
			if s := strings.TrimSpace(f.stdout.String()); s != "" {
				t.Errorf("interrupted fork printed %q", s)
			}
			t.Logf("stderr: %s", f.stderr.String())
			if !strings.Contains(f.stderr.String(), "interrupted") {
				t.Errorf("stderr does not say the fork was interrupted:\n%s", f.stderr.String())
			}
			e.parentRuns(t, "counter")
			assertSame(t, before, e.state(t))
		})
	}
}

// TestCrashContainerdKilled: containerd dies while a fork has the parent
// paused; the CLI cannot clean up and says so; after containerd is back,
// lazyfork gc thaws the parent and leaves nothing.
func TestCrashContainerdKilled(t *testing.T) {
	e := startCLIEnv(t)
	before := e.startCounterCLI(t, "counter")
	for _, stage := range []string{"after-pause", "after-first-fork-created"} {
		t.Run(stage, func(t *testing.T) {
			f := e.forkAt(t, stage, "counter", "--count", "2")
			if err := e.KillDaemon(); err != nil {
				t.Fatal(err)
			}
			_ = f.cmd.Process.Signal(os.Interrupt)
			if err := f.wait(t); err == nil {
				t.Error("fork without containerd exited 0")
			}
			t.Logf("stderr: %s", f.stderr.String())
			// containerd is down: gc fails and keeps the record.
			if _, err := e.lf(t, "gc"); err == nil {
				t.Error("gc without containerd succeeded")
			}
			if err := e.StartDaemon(context.Background()); err != nil {
				t.Fatal(err)
			}
			// Right after its start containerd may not reach every shim
			// yet: gc says so and keeps the record; a user runs it again.
			var out string
			for try := 0; ; try++ {
				o, err := e.lf(t, "gc")
				out += o
				if err == nil {
					break
				}
				if try == 5 {
					t.Fatalf("gc: %v", err)
				}
				t.Logf("gc: %v", err)
				time.Sleep(time.Second)
			}
			t.Logf("gc:\n%s", out)
			e.parentRuns(t, "counter")
			assertSame(t, before, e.state(t))
		})
	}
}

// TestCrashConcurrentForks: several fork calls of one running parent at once,
// each its own process, all succeed; the parent runs on.
func TestCrashConcurrentForks(t *testing.T) {
	e := startCLIEnv(t)
	e.startCounterCLI(t, "counter")
	const calls = 4
	var wg sync.WaitGroup
	outs := make([]string, calls)
	errs := make([]error, calls)
	for i := range calls {
		wg.Add(1)
		go func() {
			defer wg.Done()
			outs[i], errs[i] = e.lf(t, "fork", "counter")
		}()
	}
	wg.Wait()
	for i := range calls {
		if errs[i] != nil {
			t.Errorf("fork call %d: %v", i, errs[i])
			continue
		}
		id := strings.TrimSpace(outs[i])
		e.waitTick(t, id, 0)
	}
	e.parentRuns(t, "counter")
}

// TestCrashShimKilled: one shim failure does not take a family down. A fork
// group's shim killed while a fork call restores: the parent and an earlier
// fork run on, and the call leaves nothing. The parent's own shim killed
// mid-fork: the parent goes with it (it is that shim's container), the earlier
// fork runs on, and gc leaves nothing of the call.
func TestCrashShimKilled(t *testing.T) {
	e := startCLIEnv(t)
	e.startCounterCLI(t, "counter")
	survivor := strings.TrimSpace(e.must(t, "fork", "counter"))
	e.waitTick(t, survivor, 0)
	before := e.state(t)
	initial := shimsByID(e.Address)
	if len(initial) != 2 {
		t.Fatalf("shims %v, want the parent's and the earlier fork's", initial)
	}
	if _, ok := initial[survivor]; !ok {
		t.Fatalf("the earlier fork %s has no shim of its own: %v", survivor, initial)
	}
	var parentShim int
	for id, pid := range initial {
		if id != survivor {
			parentShim = pid
		}
	}

	t.Run("fork group's shim", func(t *testing.T) {
		// Groups of two: the call's forks cannot fill the earlier fork's
		// shim, they start one of their own.
		f := e.forkAt(t, "after-first-fork-created", "counter", "--count", "2", "--shim-group", "2")
		killed := 0
		for id, pid := range shimsByID(e.Address) {
			if _, old := initial[id]; !old {
				_ = syscall.Kill(pid, syscall.SIGKILL)
				killed++
			}
		}
		if killed == 0 {
			t.Fatal("no shim serves the new fork")
		}
		_ = f.cmd.Process.Signal(os.Interrupt)
		_ = f.wait(t)
		t.Logf("stderr: %s", f.stderr.String())
		e.parentRuns(t, "counter")
		e.waitTick(t, survivor, e.waitTick(t, survivor, 0))
		e.assertSettles(t, before)
	})

	t.Run("parent's shim", func(t *testing.T) {
		f := e.forkAt(t, "after-checkpoint", "counter", "--count", "2")
		if err := syscall.Kill(parentShim, syscall.SIGKILL); err != nil {
			t.Fatal(err)
		}
		_ = f.cmd.Process.Signal(os.Interrupt)
		if err := f.wait(t); err == nil {
			t.Error("a fork whose parent's shim died exited 0")
		}
		t.Logf("stderr: %s", f.stderr.String())
		// The earlier fork is in a shim of its own: it runs on.
		e.waitTick(t, survivor, e.waitTick(t, survivor, 0))
		e.assertSettles(t, before)
	})
}

// TestGCCollectsDeadTaskReferences: a memory reference and view left by a
// task that never came to be (its shim died while creating it, and
// containerd removed its bundle before the shim's delete ran) are dropped
// by lazyfork gc, through the node API, with what only they held; a live
// fork's stay.
func TestGCCollectsDeadTaskReferences(t *testing.T) {
	e := startCLIEnv(t)
	e.startCounterCLI(t, "counter")
	fork := strings.TrimSpace(e.must(t, "fork", "counter"))
	e.waitTick(t, fork, 0)
	store, err := memfile.OpenStore(api.Root(e.Root).Mem())
	if err != nil {
		t.Fatal(err)
	}
	live := memfile.HolderContainer + e.Namespace + "/" + fork
	holders, err := store.Holders("counter")
	if err != nil || len(holders[live]) == 0 {
		t.Fatalf("the fork's reference: %v (%v)", holders, err)
	}
	// What the shim of a task that never came to be leaves.
	ghost := "ghost-" + lfRandom(3)
	ghostHolder := memfile.HolderContainer + e.Namespace + "/" + ghost
	taskRoot := filepath.Join(e.State, "io.containerd.runtime.v2.task")
	if err := store.RefBundle("counter", ghostHolder, filepath.Join(taskRoot, e.Namespace, ghost), holders[live]); err != nil {
		t.Fatal(err)
	}
	ghostView := memfile.ViewName(e.Namespace, ghost)
	if _, err := store.LinkView("counter", ghostView, holders[live]); err != nil {
		t.Fatal(err)
	}

	out := e.must(t, "gc")
	t.Logf("gc:\n%s", out)
	holders, err = store.Holders("counter")
	if err != nil {
		t.Fatal(err)
	}
	if _, ok := holders[ghostHolder]; ok {
		t.Errorf("lazyfork gc left the dead task's reference: %v", holders)
	}
	if _, err := os.Stat(store.ViewDir(ghostView)); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("lazyfork gc left the dead task's view: %v", err)
	}
	if len(holders[live]) == 0 {
		t.Errorf("lazyfork gc dropped the live fork's reference: %v", holders)
	}
	if _, err := os.Stat(store.ViewDir(memfile.ViewName(e.Namespace, fork))); err != nil {
		t.Errorf("lazyfork gc removed the live fork's view: %v", err)
	}
	e.waitTick(t, fork, e.waitTick(t, fork, 0))
	e.must(t, "delete", "-f", fork)
	e.must(t, "delete", "-f", "counter")
}
