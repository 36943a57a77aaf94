// Command ci-runner runs CI jobs in LazyFork forks of one warm build
// container: the container warms up once (toolchain imported, project built,
// test database started), LazyFork snapshots it, and every job gets a fresh
// fork that is deleted when the job is done.
//
//	ci-runner [-address /run/containerd/containerd.sock] [-namespace default]
//	          [-image localhost/lazyfork/python:latest] [-jobs 3] [-tests 20] [-cold]
//
// It needs a containerd whose PATH holds containerd-shim-lazyfork-v1, the
// python test image (scripts/images.sh python; ctr images import), and root.
// -cold runs the same jobs in fresh containers instead, to compare.
package main

import (
	"context"
	"flag"
	"fmt"
	"os"
	"time"

	containerd "github.com/containerd/containerd/v2/client"
	"github.com/containerd/containerd/v2/pkg/namespaces"

	lfclient "github.com/lazyfork/lazyfork/client"
	"github.com/lazyfork/lazyfork/examples/ci-runner/runner"
)

func main() {
	address := flag.String("address", "/run/containerd/containerd.sock", "containerd socket")
	ns := flag.String("namespace", "default", "containerd namespace")
	image := flag.String("image", "localhost/lazyfork/python:latest", "build image (python3)")
	jobs := flag.Int("jobs", 3, "jobs to run")
	tests := flag.Int("tests", 20, "tests per job")
	cold := flag.Bool("cold", false, "run each job in a fresh container instead of a fork")
	small := flag.Bool("small", false, "small warm-up (CI size)")
	root := flag.String("root", "/run/lazyfork", "LazyFork root (the shim's LAZYFORK_ROOT)")
	logs := flag.String("logs", "", "directory for job logs (default: a temp dir)")
	flag.Parse()
	if err := run(*address, *ns, *image, *root, *logs, *jobs, *tests, *cold, *small); err != nil {
		fmt.Fprintln(os.Stderr, "ci-runner:", err)
		os.Exit(1)
	}
}

func run(address, ns, ref, root, logs string, jobs, tests int, cold, small bool) error {
	cd, err := containerd.New(address)
	if err != nil {
		return err
	}
	defer cd.Close()
	ctx := namespaces.WithNamespace(context.Background(), ns)
	img, err := cd.GetImage(ctx, ref)
	if err != nil {
		return fmt.Errorf("image %s (import it first): %w", ref, err)
	}
	if logs == "" {
		if logs, err = os.MkdirTemp("", "ci-runner-"); err != nil {
			return err
		}
	}
	size := runner.Default
	if small {
		size = runner.Small
	}
	r := &runner.Runner{Client: cd, LazyFork: lfclient.New(cd, lfclient.WithRoot(root)), Image: img, Size: size, LogDir: logs}
	var w *runner.Warm
	if !cold {
		if w, err = r.StartWarm(ctx, "ci-warm"); err != nil {
			return err
		}
		defer r.Remove(context.WithoutCancel(ctx), w.ID)
		defer r.LazyFork.RemoveSnapshot(context.WithoutCancel(ctx), w.Snapshot)
		fmt.Printf("warm container %s: warm-up %v, snapshot %v, %.1f MB\n", w.ID,
			w.WarmUp.Round(time.Millisecond), w.Checkpoint.Round(time.Millisecond), float64(w.Memory)/1e6)
	}
	for i := 1; i <= jobs; i++ {
		job := runner.Job{Name: fmt.Sprintf("job%d", i), Tests: tests}
		var res *runner.Result
		if cold {
			res, err = r.RunCold(ctx, job)
		} else {
			res, err = r.RunForked(ctx, w, job)
		}
		if err != nil {
			return err
		}
		fmt.Printf("%s in %s: first test output after %v, done after %v, %.1f MB, passed %d, failed %d (log %s/%s.log)\n",
			job.Name, res.Container, res.FirstOutput.Round(time.Millisecond), res.Total.Round(time.Millisecond),
			float64(res.Memory)/1e6, res.Passed, res.Failed, logs, res.Container)
		if res.Failed > 0 {
			return fmt.Errorf("%s: %d tests failed", job.Name, res.Failed)
		}
	}
	return nil
}
