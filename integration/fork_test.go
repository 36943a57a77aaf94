package integration

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/containerd/cgroups/v3"
	containerd "github.com/containerd/containerd/v2/client"
	"github.com/containerd/containerd/v2/pkg/cio"

	lfclient "github.com/lazyfork/lazyfork/client"
	"github.com/lazyfork/lazyfork/integration/harness"
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

// startCounter runs counter.py holding heapMiB in a LazyFork container.
func (e *lfEnv) startCounter(t *testing.T, ctx context.Context, img containerd.Image, id string, heapMiB int) *counter {
	t.Helper()
	_, task := e.run(t, ctx, img, id, []string{"python3", counterPy, strconv.Itoa(heapMiB), "--interval", "0.05"})
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
	e := startLF(t, harness.Options{})
	ctx := e.ctx(t)
	img, err := e.ImportImage(ctx, "python")
	if err != nil {
		t.Fatal(err)
	}
	parent := e.startCounter(t, ctx, img, "par-"+lfRandom(4), 256)
	parentCtr, err := e.Client().LoadContainer(ctx, parent.id)
	if err != nil {
		t.Fatal(err)
	}

	res, err := e.lfClient().Fork(ctx, parent.id, 10, e.logIO())
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("fork: paused %v, checkpoint %v, upper copy %v, 10 restores %v", res.Paused, res.Checkpoint, res.CopyUpper, res.Restore)
	// Memory right after restore, before anything reads the heap.
	parentMem := memoryUsage(t, ctx, parentCtr)
	var total uint64
	for _, f := range res.Forks {
		m := memoryUsage(t, ctx, f.Container)
		total += m
		if m >= 2<<20 {
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
		if l[lfclient.LabelParent] != parent.id || l[lfclient.LabelFamily] != parent.id || l[lfclient.LabelSnapshot] == "" {
			t.Errorf("%s: labels %v", f.Container.ID(), l)
		}
	}
	// One shim process serves the family.
	if n := len(harness.ShimPIDs(e.Address)); n != 1 {
		t.Errorf("%d shim processes serve one family, want 1", n)
	}
}
