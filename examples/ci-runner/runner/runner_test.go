package runner_test

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"testing"
	"time"

	lfclient "github.com/lazyfork/lazyfork/client"
	"github.com/lazyfork/lazyfork/examples/ci-runner/runner"
	"github.com/lazyfork/lazyfork/integration/harness"
	"github.com/lazyfork/lazyfork/internal/testutil"
)

// Setup is a private containerd running LazyFork's shim with a private
// LazyFork root, and a Runner on it (shared with bench/cirunner).
func setup(t *testing.T, size runner.Size) (*runner.Runner, context.Context) {
	t.Helper()
	testutil.RequiresRoot(t)
	testutil.RequiresCRIU(t)
	testutil.RequiresBinary(t, "containerd")
	repo, err := harness.RepoRoot()
	if err != nil {
		t.Fatal(err)
	}
	bin := t.TempDir()
	cmd := exec.Command("go", "build", "-o", bin+"/", "./cmd/containerd-shim-lazyfork-v1", "./cmd/containerd-shim-lazyfork-v1-full")
	cmd.Dir = repo
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("build shim: %v\n%s", err, out)
	}
	root, err := os.MkdirTemp("/tmp", "lfr-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := harness.RemoveLazyForkRoot(root); err != nil {
			t.Errorf("remove LazyFork root %s: %v", root, err)
		}
	})
	h := harness.StartT(t, harness.Options{BinDirs: []string{bin}, Env: []string{"LAZYFORK_ROOT=" + root}})
	ctx, cancel := context.WithTimeout(h.Context(context.Background()), 3*time.Minute)
	t.Cleanup(cancel)
	img, err := h.ImportImage(ctx, "python")
	if err != nil {
		t.Fatal(err)
	}
	logs, err := h.TempDir("logs-")
	if err != nil {
		t.Fatal(err)
	}
	return &runner.Runner{
		Client:       h.Client(),
		LazyFork:     lfclient.New(h.Client(), lfclient.WithRoot(root)),
		Image:        img,
		Size:         size,
		LogDir:       logs,
		CgroupParent: h.CgroupParent,
	}, ctx
}

// TestCIRunnerSmall is the example at CI size: a warm build container,
// three jobs each in its own fork (deleted after), and one cold job; every
// test of every job passes and no job container is left.
func TestCIRunnerSmall(t *testing.T) {
	r, ctx := setup(t, runner.Small)
	w, err := r.StartWarm(ctx, "warm")
	if err != nil {
		t.Fatal(err)
	}
	var results []*runner.Result
	for i := 1; i <= 3; i++ {
		res, err := r.RunForked(ctx, w, runner.Job{Name: fmt.Sprintf("j%d", i), Tests: 20})
		if err != nil {
			t.Fatal(err)
		}
		results = append(results, res)
	}
	cold, err := r.RunCold(ctx, runner.Job{Name: "c1", Tests: 20})
	if err != nil {
		t.Fatal(err)
	}
	results = append(results, cold)
	for _, res := range results {
		if res.Passed != 20 || res.Failed != 0 {
			t.Errorf("job %s in %s: passed=%d failed=%d, want 20/0", res.Job.Name, res.Container, res.Passed, res.Failed)
		}
		t.Logf("job %s (%s): first output %v, done %v, memory %d kB", res.Job.Name, res.Container,
			res.FirstOutput.Round(time.Millisecond), res.Total.Round(time.Millisecond), res.Memory>>10)
	}
	cs, err := r.Client.Containers(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if len(cs) != 1 || cs[0].ID() != "warm" {
		var ids []string
		for _, c := range cs {
			ids = append(ids, c.ID())
		}
		t.Errorf("containers after the jobs: %v, want only the warm one", ids)
	}
	if err := r.LazyFork.RemoveSnapshot(ctx, w.Snapshot); err != nil {
		t.Error(err)
	}
}
