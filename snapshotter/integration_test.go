//go:build linux

package snapshotter_test

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	containerd "github.com/containerd/containerd/v2/client"
	"github.com/containerd/containerd/v2/core/leases"
	"github.com/containerd/containerd/v2/core/snapshots"
	"github.com/containerd/containerd/v2/core/snapshots/testsuite"
	"github.com/containerd/containerd/v2/pkg/cio"
	"github.com/containerd/containerd/v2/pkg/oci"

	"github.com/lazyfork/lazyfork/integration/harness"
	"github.com/lazyfork/lazyfork/internal/testutil"
	lazyforkv1 "github.com/lazyfork/lazyfork/proto/lazyfork/v1"
	"github.com/lazyfork/lazyfork/snapshotter/client"
)

var (
	buildOnce sync.Once
	binPath   string
	builtDir  string // removed by TestMain when we built the binary
	buildErr  error
)

func TestMain(m *testing.M) {
	code := m.Run()
	if builtDir != "" {
		os.RemoveAll(builtDir)
	}
	os.Exit(code)
}

// snapshotterBinary builds cmd/lazyfork-snapshotter once per test binary
// (or takes it from $LAZYFORK_BIN, as `make integration` sets).
func snapshotterBinary(t *testing.T) string {
	t.Helper()
	buildOnce.Do(func() {
		if dir := os.Getenv("LAZYFORK_BIN"); dir != "" {
			p := filepath.Join(dir, "lazyfork-snapshotter")
			if _, err := os.Stat(p); err == nil {
				binPath = p
				return
			}
		}
		dir, err := os.MkdirTemp("", "lfsn-bin-")
		if err != nil {
			buildErr = err
			return
		}
		builtDir = dir
		binPath = filepath.Join(dir, "lazyfork-snapshotter")
		out, err := exec.Command("go", "build", "-o", binPath, "github.com/lazyfork/lazyfork/cmd/lazyfork-snapshotter").CombinedOutput()
		if err != nil {
			buildErr = fmt.Errorf("go build: %v\n%s", err, out)
		}
	})
	if buildErr != nil {
		t.Fatal(buildErr)
	}
	return binPath
}

// daemon is a lazyfork-snapshotter process run by a test.
type daemon struct {
	t       *testing.T
	bin     string
	root    string
	address string
	logPath string
	cmd     *exec.Cmd
	done    chan struct{}
}

func startDaemon(t *testing.T) *daemon {
	t.Helper()
	// Short paths: unix sockets are limited to 107 bytes.
	dir, err := os.MkdirTemp("", "lfsn-")
	if err != nil {
		t.Fatal(err)
	}
	d := &daemon{
		t:       t,
		bin:     snapshotterBinary(t),
		root:    filepath.Join(dir, "root"),
		address: filepath.Join(dir, "sock", "sn.sock"),
		logPath: filepath.Join(dir, "snapshotter.log"),
	}
	t.Cleanup(func() {
		d.stop(syscall.SIGTERM)
		if t.Failed() {
			b, _ := os.ReadFile(d.logPath)
			t.Logf("lazyfork-snapshotter log:\n%s", b)
		}
		os.RemoveAll(dir)
	})
	d.start()
	return d
}

func (d *daemon) start() {
	d.t.Helper()
	logf, err := os.OpenFile(d.logPath, os.O_WRONLY|os.O_CREATE|os.O_APPEND, 0o644)
	if err != nil {
		d.t.Fatal(err)
	}
	defer logf.Close()
	// A LazyFork root of its own: never the host's, which its memory
	// collection would walk.
	d.cmd = exec.Command(d.bin, "--root", d.root, "--address", d.address, "--log-level", "debug",
		"--lazyfork-root", filepath.Join(filepath.Dir(d.root), "lazyfork"))
	d.cmd.Stdout, d.cmd.Stderr = logf, logf
	if err := d.cmd.Start(); err != nil {
		d.t.Fatal(err)
	}
	d.done = make(chan struct{})
	go func(cmd *exec.Cmd, done chan struct{}) {
		cmd.Wait()
		close(done)
	}(d.cmd, d.done)
	deadline := time.Now().Add(30 * time.Second)
	for {
		if c, err := client.Dial(context.Background(), client.TTRPCAddress(d.address)); err == nil {
			_, err = c.Status(context.Background(), &lazyforkv1.StatusRequest{})
			c.Close()
			if err == nil {
				return
			}
		}
		select {
		case <-d.done:
			b, _ := os.ReadFile(d.logPath)
			d.t.Fatalf("lazyfork-snapshotter exited at start:\n%s", b)
		default:
		}
		if time.Now().After(deadline) {
			d.t.Fatal("lazyfork-snapshotter did not answer within 30s")
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// stop signals the process we started (by PID) and waits for it.
func (d *daemon) stop(sig syscall.Signal) {
	if d.cmd == nil || d.cmd.Process == nil {
		return
	}
	select {
	case <-d.done:
		return
	default:
	}
	d.cmd.Process.Signal(sig)
	select {
	case <-d.done:
	case <-time.After(90 * time.Second):
		d.cmd.Process.Kill()
		<-d.done
	}
}

func (d *daemon) status(t *testing.T) *lazyforkv1.StatusResponse {
	t.Helper()
	c, err := client.Dial(context.Background(), client.TTRPCAddress(d.address))
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	st, err := c.Status(context.Background(), &lazyforkv1.StatusRequest{})
	if err != nil {
		t.Fatal(err)
	}
	return st
}

func startStack(t *testing.T) (*daemon, *harness.Containerd) {
	testutil.RequiresBinary(t, "containerd")
	testutil.RequiresBinary(t, "runc")
	d := startDaemon(t)
	c := harness.StartT(t, harness.Options{ProxyPlugins: []harness.ProxyPlugin{{
		Name: client.SnapshotterName, Type: "snapshot", Address: d.address, ExportsRoot: d.root,
	}}})
	return d, c
}

func TestSnapshotterSuiteThroughContainerd(t *testing.T) {
	_, c := startStack(t)
	// "overlayfs": the suite's name for overlay's rename limit (see the
	// in-process suite).
	testsuite.SnapshotterSuite(t, "overlayfs", func(ctx context.Context, root string) (snapshots.Snapshotter, func() error, error) {
		return c.Client().SnapshotService(client.SnapshotterName), nil, nil
	})
}

// execOut runs args in task's container and returns its output.
func execOut(ctx context.Context, task containerd.Task, args ...string) (string, error) {
	spec, err := task.Spec(ctx)
	if err != nil {
		return "", err
	}
	pspec := *spec.Process
	pspec.Args = args
	pspec.Terminal = false
	// The shim writes the output to a file itself: reading after Delete
	// then sees all of it (a fifo copy can lose the tail to Delete's cancel).
	f, err := os.CreateTemp("", "lfsn-exec-")
	if err != nil {
		return "", err
	}
	f.Close()
	defer os.Remove(f.Name())
	id := fmt.Sprintf("x%d", time.Now().UnixNano())
	p, err := task.Exec(ctx, id, &pspec, cio.LogFile(f.Name()))
	if err != nil {
		return "", err
	}
	ch, err := p.Wait(ctx)
	if err != nil {
		p.Delete(ctx)
		return "", err
	}
	if err := p.Start(ctx); err != nil {
		p.Delete(ctx)
		return "", err
	}
	st := <-ch
	// Delete waits for the shim to flush the output and closes our copy.
	if _, err := p.Delete(ctx); err != nil {
		return "", err
	}
	out, err := os.ReadFile(f.Name())
	if err != nil {
		return "", err
	}
	if st.ExitCode() != 0 {
		return string(out), fmt.Errorf("%v exited %d: %s", args, st.ExitCode(), out)
	}
	return string(out), nil
}

func sh(t *testing.T, ctx context.Context, task containerd.Task, script string) string {
	t.Helper()
	out, err := execOut(ctx, task, "sh", "-c", script)
	if err != nil {
		t.Fatalf("exec %q: %v", script, err)
	}
	return strings.TrimSpace(out)
}

// newContainerOn starts a sleeping busybox container on an existing snapshot.
func newContainerOn(t *testing.T, ctx context.Context, c *harness.Containerd, img containerd.Image, id, snapshotKey string) containerd.Task {
	t.Helper()
	ctr, err := c.Client().NewContainer(ctx, id,
		containerd.WithImage(img),
		containerd.WithSnapshotter(client.SnapshotterName),
		containerd.WithSnapshot(snapshotKey),
		containerd.WithNewSpec(oci.WithImageConfig(img), oci.WithProcessArgs("sleep", "3600"), oci.WithCgroup(c.CgroupPath(id))),
		containerd.WithRuntime(harness.RuncRuntime, c.RuntimeOptions()),
	)
	if err != nil {
		t.Fatal(err)
	}
	task, err := c.StartTask(ctx, ctr)
	if err != nil {
		t.Fatal(err)
	}
	return task
}

// freeze copies the task's rootfs while it runs, pauses it, brings the copy
// up to date and commits it as frozen, under a lease that the caller deletes
// once forks are prepared, and resumes the task.
func freeze(t *testing.T, ctx context.Context, c *harness.Containerd, task containerd.Task, active, frozen string, between ...func()) context.Context {
	t.Helper()
	ls := c.Client().LeasesService()
	l, err := ls.Create(ctx, leases.WithRandomID(), leases.WithExpiration(10*time.Minute))
	if err != nil {
		t.Fatal(err)
	}
	lctx := leases.WithLease(ctx, l.ID)
	pending, err := client.StartFreeze(lctx, c.Client().SnapshotService(client.SnapshotterName), active, frozen)
	if err != nil {
		t.Fatal(err)
	}
	for _, f := range between {
		f() // the task still runs after the bulk copy
	}
	if err := task.Pause(ctx); err != nil {
		t.Fatal(err)
	}
	_, ferr := pending.Commit(lctx)
	if err := task.Resume(ctx); err != nil {
		t.Fatal(err)
	}
	if ferr != nil {
		t.Fatal(ferr)
	}
	return lctx
}

func dropLease(t *testing.T, ctx, lctx context.Context, c *harness.Containerd) {
	t.Helper()
	id, _ := leases.FromContext(lctx)
	if err := c.Client().LeasesService().Delete(ctx, leases.Lease{ID: id}, leases.SynchronousDelete); err != nil {
		t.Fatal(err)
	}
}

// collect runs containerd's garbage collector now: a synchronous delete of
// an empty lease triggers a full collection.
func collect(t *testing.T, ctx context.Context, c *harness.Containerd) {
	t.Helper()
	ls := c.Client().LeasesService()
	l, err := ls.Create(ctx, leases.WithRandomID())
	if err != nil {
		t.Fatal(err)
	}
	if err := ls.Delete(ctx, l, leases.SynchronousDelete); err != nil {
		t.Fatal(err)
	}
}

func removeContainer(t *testing.T, ctx context.Context, c *harness.Containerd, task containerd.Task) {
	t.Helper()
	if _, err := task.Delete(ctx, containerd.WithProcessKill); err != nil {
		t.Fatal(err)
	}
	ctr, err := c.Client().LoadContainer(ctx, task.ID())
	if err != nil {
		t.Fatal(err)
	}
	if err := ctr.Delete(ctx, containerd.WithSnapshotCleanup); err != nil {
		t.Fatal(err)
	}
}

const forkCount = 10

// The fork family test: a busybox container writes small files and a 100 MB
// one, is forked 10 times at the filesystem level (freeze + 10 prepares,
// containers started on them), forks fork again; then the snapshotter is
// killed and restarted under the running containers; then containers go
// away one by one and containerd's GC frees each frozen layer exactly when
// its last user has gone.
func TestForkFamilyThroughContainerd(t *testing.T) {
	d, c := startStack(t)
	ctx := c.Context(context.Background())
	img, err := c.ImportImage(ctx, "busybox", harness.WithSnapshotter(client.SnapshotterName))
	if err != nil {
		t.Fatal(err)
	}
	sn := c.Client().SnapshotService(client.SnapshotterName)

	parentCtr, err := c.NewContainer(ctx, "lfsn-parent", harness.ContainerConfig{
		Image: img, Snapshotter: client.SnapshotterName, Args: []string{"sleep", "3600"},
	})
	if err != nil {
		t.Fatal(err)
	}
	parent, err := c.StartTask(ctx, parentCtr)
	if err != nil {
		t.Fatal(err)
	}
	bigSum := sh(t, ctx, parent, `set -e
		echo small-at-fork > /small
		mkdir -p /data && echo nested > /data/nested
		dd if=/dev/urandom of=/big bs=1M count=100 2>/dev/null
		rm /bin/vi
		rm -rf /var/tmp && mkdir /var/tmp && echo fresh > /var/tmp/only
		sha256sum /big | cut -d" " -f1`)

	lctx := freeze(t, ctx, c, parent, "lfsn-parent", "lfsn-frozen1", func() {
		// Between the bulk copy and the pause: the fork must see these.
		sh(t, ctx, parent, `set -e; echo between > /between; echo small-at-fork > /small; echo more >> /data/nested`)
	})

	// The parent carries on after the fork instant.
	sh(t, ctx, parent, `set -e; echo parent-later > /small; echo x >> /big; echo new > /after; rm /data/nested`)

	forks := make([]containerd.Task, forkCount)
	for i := range forks {
		key := fmt.Sprintf("lfsn-fork-%d", i)
		if _, err := sn.Prepare(lctx, key, "lfsn-frozen1"); err != nil {
			t.Fatal(err)
		}
		forks[i] = newContainerOn(t, ctx, c, img, key, key)
	}
	dropLease(t, ctx, lctx, c)

	forkView := `cat /small /between; cat /data/nested; sha256sum /big | cut -d" " -f1
		[ -e /after ] && echo after-visible; [ -e /bin/vi ] && echo vi-visible
		ls /var/tmp; [ -e /bin/sh ] && echo base-ok`
	want := "small-at-fork\nbetween\nnested\nmore\n" + bigSum + "\nonly\nbase-ok"
	for i, f := range forks {
		if got := sh(t, ctx, f, forkView); got != want {
			t.Errorf("fork %d sees:\n%s\nwant:\n%s", i, got, want)
		}
	}
	// Each fork writes and deletes.
	for i, f := range forks {
		sh(t, ctx, f, fmt.Sprintf("echo mine > /fork-%d; rm /data/nested; echo fork-%d > /small", i, i))
	}
	for i, f := range forks {
		got := sh(t, ctx, f, "ls / | grep '^fork-' | tr '\\n' ' '; cat /small; [ -e /data/nested ] || echo nested-gone")
		if want := fmt.Sprintf("fork-%d fork-%d\nnested-gone", i, i); got != want {
			t.Errorf("fork %d after the forks' writes sees %q, want %q", i, got, want)
		}
	}
	if got := sh(t, ctx, parent, "ls / | grep -c '^fork-' || true; cat /small"); got != "0\nparent-later" {
		t.Errorf("parent sees %q, want no fork files and its own /small", got)
	}

	// A fork of a fork.
	lctx2 := freeze(t, ctx, c, forks[0], "lfsn-fork-0", "lfsn-frozen2")
	if _, err := sn.Prepare(lctx2, "lfsn-ff", "lfsn-frozen2"); err != nil {
		t.Fatal(err)
	}
	ff := newContainerOn(t, ctx, c, img, "lfsn-ff", "lfsn-ff")
	dropLease(t, ctx, lctx2, c)
	if got := sh(t, ctx, ff, `cat /small /fork-0; sha256sum /big | cut -d" " -f1; [ -e /data/nested ] || echo nested-gone`); got != "fork-0\nmine\n"+bigSum+"\nnested-gone" {
		t.Errorf("fork of fork sees %q", got)
	}

	// Restart: kill -9 the snapshotter under the running containers.
	d.stop(syscall.SIGKILL)
	if got := sh(t, ctx, forks[3], "echo during-outage > /outage; cat /outage"); got != "during-outage" {
		t.Errorf("fork's rootfs during the outage: %q", got)
	}
	d.start()
	if st := d.status(t); len(st.Missing) != 0 || st.Frozen != 2 || st.Building != 0 {
		t.Errorf("status after restart: %+v", st)
	}
	for i, f := range forks {
		if got := sh(t, ctx, f, "cat /small"); got != fmt.Sprintf("fork-%d", i) {
			t.Errorf("fork %d after restart reads %q", i, got)
		}
	}
	// New work after the restart: one more fork of the first frozen layer.
	lctx3, done, err := c.Client().WithLease(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := sn.Prepare(lctx3, "lfsn-late", "lfsn-frozen1"); err != nil {
		t.Fatal(err)
	}
	late := newContainerOn(t, ctx, c, img, "lfsn-late", "lfsn-late")
	if err := done(ctx); err != nil {
		t.Fatal(err)
	}
	if got := sh(t, ctx, late, "cat /small"); got != "small-at-fork" {
		t.Errorf("fork made after the restart reads %q", got)
	}

	// Lifetime through containerd's GC.
	frozenCount := func() uint64 {
		collect(t, ctx, c)
		return d.status(t).Frozen
	}
	removeContainer(t, ctx, c, parent)
	if n := frozenCount(); n != 2 {
		t.Fatalf("after the parent went: %d frozen layers, want 2", n)
	}
	for _, f := range append(forks[1:], late) {
		removeContainer(t, ctx, c, f)
	}
	if n := frozenCount(); n != 2 {
		t.Fatalf("with fork 0 and its fork left: %d frozen layers, want 2", n)
	}
	removeContainer(t, ctx, c, ff)
	if n := frozenCount(); n != 1 {
		t.Fatalf("after the fork of fork went: %d frozen layers, want 1 (frozen2 freed)", n)
	}
	if _, err := sn.Stat(ctx, "lfsn-frozen2"); err == nil {
		t.Error("containerd still lists lfsn-frozen2")
	}
	removeContainer(t, ctx, c, forks[0])
	if n := frozenCount(); n != 0 {
		t.Fatalf("after the last fork went: %d frozen layers, want 0", n)
	}
	st := d.status(t)
	entries, _ := os.ReadDir(filepath.Join(d.root, "snapshots"))
	// Left: the image's one layer.
	if st.Active != 0 || st.Committed != 1 || len(entries) != 1 {
		t.Errorf("after everything went: %+v, %d dirs", st, len(entries))
	}
}

// containerdPID finds the daemon the harness started for c by its exact
// command line (the harness does not export it).
func containerdPID(c *harness.Containerd) (int, error) {
	cfg := filepath.Join(c.Dir, "config.toml")
	entries, err := os.ReadDir("/proc")
	if err != nil {
		return 0, err
	}
	for _, e := range entries {
		pid, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		b, err := os.ReadFile(filepath.Join("/proc", e.Name(), "cmdline"))
		if err != nil {
			continue
		}
		args := strings.Split(strings.TrimRight(string(b), "\x00"), "\x00")
		if len(args) == 3 && filepath.Base(args[0]) == "containerd" && args[1] == "--config" && args[2] == cfg {
			return pid, nil
		}
	}
	return 0, fmt.Errorf("no containerd running with %s", cfg)
}

// Killing containerd and the snapshotter with SIGKILL under running forks
// and starting them again: the forks' rootfs keep working, containerd still
// knows every snapshot, new forks stack on the old frozen layer, and GC frees
// the frozen layer when its last user goes.
func TestRestartContainerdAndSnapshotter(t *testing.T) {
	testutil.RequiresBinary(t, "containerd")
	testutil.RequiresBinary(t, "runc")
	// Registered before the harness, so it runs after the harness's
	// teardown has used the restarted daemon.
	var restarted *exec.Cmd
	t.Cleanup(func() {
		if restarted != nil && restarted.Process != nil {
			restarted.Process.Signal(syscall.SIGTERM)
			done := make(chan struct{})
			go func() { restarted.Wait(); close(done) }()
			select {
			case <-done:
			case <-time.After(30 * time.Second):
				restarted.Process.Kill()
				<-done
			}
		}
	})
	d, c := startStack(t)
	ctx := c.Context(context.Background())
	img, err := c.ImportImage(ctx, "busybox", harness.WithSnapshotter(client.SnapshotterName))
	if err != nil {
		t.Fatal(err)
	}
	sn := c.Client().SnapshotService(client.SnapshotterName)
	parentCtr, err := c.NewContainer(ctx, "lfsn-rparent", harness.ContainerConfig{
		Image: img, Snapshotter: client.SnapshotterName, Args: []string{"sleep", "3600"},
	})
	if err != nil {
		t.Fatal(err)
	}
	parent, err := c.StartTask(ctx, parentCtr)
	if err != nil {
		t.Fatal(err)
	}
	sh(t, ctx, parent, "echo at-fork > /mark")
	lctx := freeze(t, ctx, c, parent, "lfsn-rparent", "lfsn-rfrozen")
	var forks []containerd.Task
	for i := range 2 {
		key := fmt.Sprintf("lfsn-rfork-%d", i)
		if _, err := sn.Prepare(lctx, key, "lfsn-rfrozen"); err != nil {
			t.Fatal(err)
		}
		forks = append(forks, newContainerOn(t, ctx, c, img, key, key))
	}
	dropLease(t, ctx, lctx, c)

	// Both daemons die at once.
	pid, err := containerdPID(c)
	if err != nil {
		t.Fatal(err)
	}
	must(t, syscall.Kill(pid, syscall.SIGKILL))
	d.stop(syscall.SIGKILL)
	for syscall.Kill(pid, 0) == nil {
		time.Sleep(10 * time.Millisecond)
	}

	// The containers run on: their overlays belong to the kernel.
	cfgPath := filepath.Join(c.Dir, "config.toml")
	shimPIDs := harness.ShimPIDs(c.Address)
	if len(shimPIDs) == 0 {
		t.Fatal("no shim survived containerd")
	}

	d.start()
	logf, err := os.OpenFile(c.LogPath, os.O_WRONLY|os.O_APPEND, 0)
	if err != nil {
		t.Fatal(err)
	}
	restarted = exec.Command(filepath.Join(filepath.Dir(mustLookPath(t, "containerd")), "containerd"), "--config", cfgPath)
	restarted.Dir, restarted.Stdout, restarted.Stderr = c.Dir, logf, logf
	restarted.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	if err := restarted.Start(); err != nil {
		t.Fatal(err)
	}
	logf.Close()
	// The harness's client reconnects by itself.
	deadline := time.Now().Add(30 * time.Second)
	for {
		if ok, err := c.Client().IsServing(ctx); err == nil && ok {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("restarted containerd does not serve")
		}
		time.Sleep(50 * time.Millisecond)
	}

	for i, f := range forks {
		task, err := c.Client().LoadContainer(ctx, f.ID())
		if err != nil {
			t.Fatal(err)
		}
		tk, err := task.Task(ctx, nil)
		if err != nil {
			t.Fatalf("fork %d's task after the restart: %v", i, err)
		}
		forks[i] = tk
		if got := sh(t, ctx, tk, "cat /mark; echo after > /after; cat /after"); got != "at-fork\nafter" {
			t.Errorf("fork %d after the restarts: %q", i, got)
		}
	}
	if st := d.status(t); len(st.Missing) != 0 || st.Frozen != 1 {
		t.Errorf("snapshotter status after the restarts: %+v", st)
	}
	if _, err := sn.Stat(ctx, "lfsn-rfrozen"); err != nil {
		t.Errorf("containerd lost the frozen layer: %v", err)
	}
	lctx2, done, err := c.Client().WithLease(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := sn.Prepare(lctx2, "lfsn-rlate", "lfsn-rfrozen"); err != nil {
		t.Fatal(err)
	}
	late := newContainerOn(t, ctx, c, img, "lfsn-rlate", "lfsn-rlate")
	must(t, done(ctx))
	if got := sh(t, ctx, late, "cat /mark"); got != "at-fork" {
		t.Errorf("fork made after the restarts reads %q", got)
	}

	ptask, err := parentCtr.Task(ctx, nil)
	if err != nil {
		t.Fatal(err)
	}
	for _, tk := range append(forks, late, ptask) {
		removeContainer(t, ctx, c, tk)
	}
	collect(t, ctx, c)
	if st := d.status(t); st.Frozen != 0 || st.Active != 0 {
		t.Errorf("after every container went: %+v", st)
	}
}

func mustLookPath(t *testing.T, name string) string {
	t.Helper()
	p, err := exec.LookPath(name)
	if err != nil {
		t.Fatal(err)
	}
	return p
}

func must(t *testing.T, err error) {
	t.Helper()
	if err != nil {
		t.Fatal(err)
	}
}
