package integration

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/hex"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	tasksapi "github.com/containerd/containerd/api/services/tasks/v1"
	containerd "github.com/containerd/containerd/v2/client"
	"github.com/containerd/containerd/v2/pkg/cio"
	"github.com/containerd/containerd/v2/pkg/oci"
	specs "github.com/opencontainers/runtime-spec/specs-go"

	"github.com/lazyfork/lazyfork/integration/harness"
	"github.com/lazyfork/lazyfork/internal/testutil"
)

// lfRuntime is LazyFork's runtime type.
const lfRuntime = "io.containerd.lazyfork.v1"

// lfEnv is a private containerd that runs LazyFork's shim, with a private
// LazyFork root (its own tmpfs, unmounted at the end).
type lfEnv struct {
	*harness.Containerd
	Root string // LAZYFORK_ROOT of the shims
	Bin  string // directory holding containerd-shim-lazyfork-v1 and lazyfork
}

// lfBin returns a directory with LazyFork's binaries: $LAZYFORK_BIN (make
// integration) or a fresh `make build` into a temporary directory.
func lfBin(t testing.TB) string {
	t.Helper()
	if d := os.Getenv("LAZYFORK_BIN"); d != "" {
		if _, err := os.Stat(filepath.Join(d, "lazyfork-snapshotter")); err == nil {
			return d
		}
	}
	repo, err := harness.RepoRoot()
	if err != nil {
		t.Fatal(err)
	}
	// Everything `make build` puts beside the shim: the move's helper
	// (lazyfork-rehome) and the CRIU proxy too, which the shim uses when it
	// finds them and the tests check it does.
	dir := t.TempDir()
	cmd := exec.Command("make", "--no-print-directory", "build", "BINDIR="+dir)
	cmd.Dir = repo
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("build LazyFork binaries: %v\n%s", err, out)
	}
	return dir
}

func lfRandom(n int) string {
	b := make([]byte, n)
	if _, err := rand.Read(b); err != nil {
		panic(err)
	}
	return hex.EncodeToString(b)
}

// startLF starts a private containerd whose shims use a private LazyFork root.
func startLF(t *testing.T, opts harness.Options) *lfEnv {
	t.Helper()
	testutil.RequiresRoot(t)
	testutil.RequiresCRIU(t)
	testutil.RequiresBinary(t, "containerd")
	bin := lfBin(t)
	root, err := os.MkdirTemp("/tmp", "lfr-")
	if err != nil {
		t.Fatal(err)
	}
	// Registered before the harness's teardown, so it runs after it: the
	// tmpfs the shims mounted goes once nothing maps its files.
	t.Cleanup(func() {
		// Memory files are immutable: a plain RemoveAll fails where the
		// root is not LazyFork's own tmpfs.
		if err := harness.RemoveLazyForkRoot(root); err != nil {
			t.Errorf("remove LazyFork root %s: %v", root, err)
		}
	})
	opts.BinDirs = append([]string{bin}, opts.BinDirs...)
	opts.Env = append(opts.Env, "LAZYFORK_ROOT="+root)
	h := harness.StartT(t, opts)
	return &lfEnv{Containerd: h, Root: root, Bin: bin}
}

func (e *lfEnv) ctx(t *testing.T) context.Context {
	ctx, cancel := context.WithTimeout(e.Context(context.Background()), 10*time.Minute)
	t.Cleanup(cancel)
	return ctx
}

// startLFPython is startLF with default options and the python image
// imported: what most container tests begin with.
func startLFPython(t *testing.T, env ...string) (*lfEnv, context.Context, containerd.Image) {
	t.Helper()
	e := startLF(t, harness.Options{Env: env})
	ctx := e.ctx(t)
	img, err := e.ImportImage(ctx, "python")
	if err != nil {
		t.Fatal(err)
	}
	return e, ctx, img
}

// run starts a LazyFork container from image with args.
func (e *lfEnv) run(t *testing.T, ctx context.Context, img containerd.Image, id string, args []string, specOpts ...oci.SpecOpts) (containerd.Container, containerd.Task) {
	t.Helper()
	ctr, err := e.NewContainer(ctx, id, harness.ContainerConfig{
		Image:    img,
		Args:     args,
		Runtime:  lfRuntime,
		SpecOpts: specOpts,
	})
	if err != nil {
		t.Fatal(err)
	}
	task, err := e.StartTask(ctx, ctr)
	if err != nil {
		t.Fatal(err)
	}
	return ctr, task
}

// execOut runs argv in a task and returns its combined output and exit status.
// The output goes through a file:// log (written by the shim itself), which
// unlike the client's fifo copy cannot lose a short-lived process's output.
func (e *lfEnv) execOut(ctx context.Context, task containerd.Task, argv ...string) (string, uint32, error) {
	spec := &specs.Process{Args: argv, Cwd: "/", Env: []string{"PATH=/usr/local/bin:/usr/bin:/bin:/usr/sbin:/sbin"}}
	id := "x" + lfRandom(4)
	logPath := filepath.Join(e.Dir, "logs", "exec-"+task.ID()+"-"+id+".log")
	p, err := task.Exec(ctx, id, spec, cio.LogFile(logPath))
	if err != nil {
		return "", 0, err
	}
	defer p.Delete(ctx)
	ch, err := p.Wait(ctx)
	if err != nil {
		return "", 0, err
	}
	if err := p.Start(ctx); err != nil {
		return "", 0, err
	}
	code, _, err := (<-ch).Result()
	if err != nil {
		return "", 0, err
	}
	if _, err := p.Delete(ctx); err != nil { // drains the shim's copy into the file
		return "", 0, err
	}
	out, err := os.ReadFile(logPath)
	return string(out), code, err
}

// TestShimBehavesLikeRunc drives a LazyFork container through the Go client the
// way any runc container is driven, and checks what LazyFork adds to it.
func TestShimBehavesLikeRunc(t *testing.T) {
	e, ctx, img := startLFPython(t)
	id := "shim-" + lfRandom(4)
	_, task := e.run(t, ctx, img, id, []string{"sh", "-c", "echo overcommit=$(cat /proc/sys/vm/overcommit_memory); exec sleep 100000"})
	if _, err := harness.WaitLine(ctx, e.TaskLogPath(id), 0, func(l string) bool { return strings.HasPrefix(l, "overcommit=") }); err != nil {
		t.Fatal(err)
	}
	lines, _ := harness.ReadLines(e.TaskLogPath(id))
	if lines[0] != "overcommit=2" {
		t.Errorf("container sees %q, want overcommit=2", lines[0])
	}

	// The family memory directory is mounted read-only at /.lazyfork/mem.
	out, code, err := e.execOut(ctx, task, "sh", "-c", "grep ' /.lazyfork/mem ' /proc/self/mounts; touch /.lazyfork/mem/x 2>&1; echo rc=$?")
	if err != nil || code != 0 {
		t.Fatalf("exec: %v (exit %d) %s", err, code, out)
	}
	if !strings.Contains(out, " /.lazyfork/mem ") || !strings.Contains(out, " ro,") {
		t.Errorf("no read-only /.lazyfork/mem mount (exit %d):\n%q", code, out)
	}
	if strings.Contains(out, "rc=0") {
		t.Errorf("/.lazyfork/mem is writable:\n%s", out)
	}

	// pause / resume
	if err := task.Pause(ctx); err != nil {
		t.Fatal(err)
	}
	if st, _ := task.Status(ctx); st.Status != containerd.Paused {
		t.Errorf("status after pause %s", st.Status)
	}
	if err := task.Resume(ctx); err != nil {
		t.Fatal(err)
	}
	if st, _ := task.Status(ctx); st.Status != containerd.Running {
		t.Errorf("status after resume %s", st.Status)
	}
	// A checkpoint without options (what CRI sends) leaves the task running;
	// containerd exports the LazyFork snapshot to its content store.
	ck, err := e.Client().TaskService().Checkpoint(ctx, &tasksapi.CheckpointTaskRequest{ContainerID: id})
	if err != nil {
		t.Fatalf("checkpoint without options: %v", err)
	}
	if len(ck.Descriptors) == 0 {
		t.Errorf("checkpoint without options exported nothing")
	}
	if st, _ := task.Status(ctx); st.Status != containerd.Running {
		t.Errorf("status after a checkpoint without options: %s", st.Status)
	}
	// metrics and pids
	if m, err := task.Metrics(ctx); err != nil || m == nil || m.Data == nil {
		t.Errorf("metrics: %v %v", m, err)
	}
	if pids, err := task.Pids(ctx); err != nil || len(pids) == 0 {
		t.Errorf("pids: %v %v", pids, err)
	}
	// kill and delete
	ch, err := task.Wait(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if err := task.Kill(ctx, syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	st := <-ch
	if code, _, _ := st.Result(); code != 137 {
		t.Errorf("exit status %d, want 137", code)
	}
	if _, err := task.Delete(ctx); err != nil {
		t.Fatal(err)
	}
	if n := len(harness.ShimPIDs(e.Address)); n > 1 {
		t.Errorf("%d shims serve one container", n)
	}
}

// TestShimTTY runs a LazyFork container on a terminal.
func TestShimTTY(t *testing.T) {
	e, ctx, img := startLFPython(t)
	id := "tty-" + lfRandom(4)
	ctr, err := e.NewContainer(ctx, id, harness.ContainerConfig{
		Image: img, Args: []string{"sh", "-c", "tty; stty size"}, Runtime: lfRuntime,
		SpecOpts: []oci.SpecOpts{oci.WithTTY, oci.WithTTYSize(80, 24)},
	})
	if err != nil {
		t.Fatal(err)
	}
	var out bytes.Buffer
	task, err := ctr.NewTask(ctx, cio.NewCreator(cio.WithStreams(nil, &out, nil), cio.WithTerminal))
	if err != nil {
		t.Fatal(err)
	}
	ch, err := task.Wait(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if err := task.Start(ctx); err != nil {
		t.Fatal(err)
	}
	<-ch
	task.IO().Wait()
	if _, err := task.Delete(ctx); err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(out.String(), "/dev/pts/") || !strings.Contains(out.String(), "24 80") {
		t.Errorf("terminal output %q", out.String())
	}
}

// ctr runs the ctr binary against the private containerd.
func (e *lfEnv) ctr(t *testing.T, args ...string) string {
	t.Helper()
	full := append([]string{"--address", e.Address, "--namespace", e.Namespace}, args...)
	out, err := exec.Command("ctr", full...).CombinedOutput()
	if err != nil {
		t.Fatalf("ctr %s: %v\n%s", strings.Join(args, " "), err, out)
	}
	return stripCgroupWarning(string(out))
}

// stripCgroupWarning drops ctr's cgroup v1 deprecation warning.
func stripCgroupWarning(s string) string {
	var keep []string
	for _, l := range strings.Split(s, "\n") {
		if !strings.Contains(l, "DEPRECATION") {
			keep = append(keep, l)
		}
	}
	return strings.Join(keep, "\n")
}

// taskStatus reads a task's status from `ctr tasks ls`.
func (e *lfEnv) taskStatus(t *testing.T, id string) string {
	t.Helper()
	for _, l := range strings.Split(e.ctr(t, "tasks", "ls"), "\n") {
		f := strings.Fields(l)
		if len(f) >= 3 && f[0] == id {
			return f[2]
		}
	}
	return ""
}
