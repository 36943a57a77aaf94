// Package runner is the CI runner of examples/ci-runner: a warm build
// container, snapshotted once, and one LazyFork fork per job; or, to compare,
// one cold container per job that warms up by itself.
//
// The build container runs warm.py (embedded): it imports its toolchain,
// builds a generated project into memory and starts a test database served
// by a thread, then waits. A job is delivered to a fork by exec (write
// /tmp/job, SIGUSR1 to PID 1); the fork runs the job's tests against the warm
// state, prints one line per test, and is deleted when the job is done.
package runner

import (
	"context"
	_ "embed"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"

	containerd "github.com/containerd/containerd/v2/client"
	"github.com/containerd/containerd/v2/pkg/cio"
	"github.com/containerd/containerd/v2/pkg/oci"
	"github.com/containerd/errdefs"
	specs "github.com/opencontainers/runtime-spec/specs-go"

	lfclient "github.com/lazyfork/lazyfork/client"

	"github.com/lazyfork/lazyfork/api"
)

//go:embed warm.py
var warmPy string

// Size is the warm-up work: the project's modules and functions per module,
// and the rows of the test database.
type Size struct{ Modules, Funcs, Rows int }

// Small is the size CI runs; Default makes a cold warm-up take seconds.
var (
	Small   = Size{Modules: 40, Funcs: 20, Rows: 20000}
	Default = Size{Modules: 2000, Funcs: 40, Rows: 500000}
)

// Args is the build container's command; job "" waits for jobs (the warm
// parent), otherwise it runs job right after warming up (a cold container).
func Args(s Size, job string) []string {
	a := []string{"python3", "-u", "-c", warmPy, strconv.Itoa(s.Modules), strconv.Itoa(s.Funcs), strconv.Itoa(s.Rows)}
	if job != "" {
		a = append(a, job)
	}
	return a
}

// Runner creates containers in the namespace of the contexts it is given.
type Runner struct {
	Client   *containerd.Client
	LazyFork *lfclient.Client
	Image    containerd.Image
	Size     Size
	// LogDir receives one log file per container (stdout and stderr).
	LogDir string
	// CgroupParent is the cgroup containers go under ("" = containerd's default).
	CgroupParent string
}

// Job is one CI job: a name and a number of tests.
type Job struct {
	Name  string
	Tests int
}

func (j Job) spec() string { return fmt.Sprintf("%s %d", j.Name, j.Tests) }

// Result is what one job measured.
type Result struct {
	Job       Job
	Container string
	// FirstOutput is from asking for the job (cold: creating its container;
	// fork: restoring its fork) to its first test line.
	FirstOutput time.Duration
	// Total is from asking for the job to its "done" line.
	Total time.Duration
	// Memory is the job container's cgroup memory usage when it is done.
	Memory         int64
	Passed, Failed int
}

// Warm is the warm build container and its kept snapshot.
type Warm struct {
	ID       string
	Snapshot string
	// WarmUp is from creating the container to its "warm" line.
	WarmUp time.Duration
	// Checkpoint is the snapshot (pause, dump, rewrite, resume).
	Checkpoint time.Duration
	Memory     int64
}

func (r *Runner) logPath(id string) string { return filepath.Join(r.LogDir, id+".log") }

func (r *Runner) create(ctx context.Context, id string, args []string) (containerd.Container, error) {
	opts := []oci.SpecOpts{oci.WithImageConfig(r.Image), oci.WithProcessArgs(args...)}
	if r.CgroupParent != "" {
		opts = append(opts, oci.WithCgroup(filepath.Join(r.CgroupParent, id)))
	}
	return r.Client.NewContainer(ctx, id,
		containerd.WithImage(r.Image),
		containerd.WithNewSnapshot(id, r.Image),
		containerd.WithRuntime(api.RuntimeName, nil),
		containerd.WithNewSpec(opts...),
	)
}

// start creates and starts a container running args, its output in its log.
func (r *Runner) start(ctx context.Context, id string, args []string) (containerd.Task, error) {
	ctr, err := r.create(ctx, id, args)
	if err != nil {
		return nil, err
	}
	task, err := ctr.NewTask(ctx, cio.LogFile(r.logPath(id)))
	if err == nil {
		err = task.Start(ctx)
	}
	if err != nil {
		_ = r.remove(context.WithoutCancel(ctx), id)
		return nil, err
	}
	return task, nil
}

// StartWarm starts the warm build container id, waits until it is warm and
// keeps a LazyFork snapshot of it.
func (r *Runner) StartWarm(ctx context.Context, id string) (_ *Warm, retErr error) {
	t0 := time.Now()
	if _, err := r.start(ctx, id, Args(r.Size, "")); err != nil {
		return nil, fmt.Errorf("start warm container: %w", err)
	}
	defer func() {
		if retErr != nil {
			_ = r.remove(context.WithoutCancel(ctx), id)
		}
	}()
	if _, err := waitLine(ctx, r.logPath(id), "warm "); err != nil {
		return nil, err
	}
	w := &Warm{ID: id, WarmUp: time.Since(t0)}
	t1 := time.Now()
	res, err := r.LazyFork.Checkpoint(ctx, id)
	if err != nil {
		return nil, fmt.Errorf("snapshot warm container: %w", err)
	}
	w.Checkpoint, w.Snapshot = time.Since(t1), res.Snapshot
	w.Memory, _ = r.memory(ctx, id)
	return w, nil
}

// RunForked runs job in a fresh fork of w and deletes the fork.
func (r *Runner) RunForked(ctx context.Context, w *Warm, job Job) (*Result, error) {
	id := w.ID + "-" + job.Name
	t0 := time.Now()
	forks, err := r.LazyFork.RestoreForks(ctx, w.ID, w.Snapshot, 1, lfclient.WithIDs(id),
		lfclient.WithIO(func(id string) cio.Creator { return cio.LogFile(r.logPath(id)) }))
	if err != nil {
		return nil, fmt.Errorf("fork for job %s: %w", job.Name, err)
	}
	defer r.remove(context.WithoutCancel(ctx), id)
	if err := deliver(ctx, forks[0].Task, job); err != nil {
		return nil, fmt.Errorf("deliver job %s: %w", job.Name, err)
	}
	return r.finish(ctx, id, job, t0)
}

// RunCold runs job in a new container that warms up by itself, then deletes it.
func (r *Runner) RunCold(ctx context.Context, job Job) (*Result, error) {
	id := "cold-" + job.Name
	t0 := time.Now()
	if _, err := r.start(ctx, id, Args(r.Size, job.spec())); err != nil {
		return nil, fmt.Errorf("cold container for job %s: %w", job.Name, err)
	}
	defer r.remove(context.WithoutCancel(ctx), id)
	return r.finish(ctx, id, job, t0)
}

func (r *Runner) finish(ctx context.Context, id string, job Job, t0 time.Time) (*Result, error) {
	log := r.logPath(id)
	if _, err := waitLine(ctx, log, "test_"); err != nil {
		return nil, err
	}
	res := &Result{Job: job, Container: id, FirstOutput: time.Since(t0)}
	done, err := waitLine(ctx, log, "job "+job.Name+" done ")
	if err != nil {
		return nil, err
	}
	res.Total = time.Since(t0)
	if _, err := fmt.Sscanf(strings.TrimPrefix(done, "job "+job.Name+" done "), "passed=%d failed=%d", &res.Passed, &res.Failed); err != nil {
		return nil, fmt.Errorf("job %s: odd result line %q", job.Name, done)
	}
	if res.Memory, err = r.memory(ctx, id); err != nil {
		return nil, err
	}
	return res, nil
}

// deliver hands a fork its job: /tmp/job, then SIGUSR1 to its PID 1.
func deliver(ctx context.Context, task containerd.Task, job Job) error {
	spec := &specs.Process{
		Args: []string{"sh", "-c", `printf '%s' "$1" > /tmp/job && kill -USR1 1`, "sh", job.spec()},
		Cwd:  "/",
		Env:  []string{"PATH=/usr/local/bin:/usr/bin:/bin:/usr/sbin:/sbin"},
	}
	p, err := task.Exec(ctx, "job-"+job.Name, spec, cio.NullIO)
	if err != nil {
		return err
	}
	defer p.Delete(context.WithoutCancel(ctx))
	ch, err := p.Wait(ctx)
	if err != nil {
		return err
	}
	if err := p.Start(ctx); err != nil {
		return err
	}
	select {
	case st := <-ch:
		if code, _, err := st.Result(); err != nil || code != 0 {
			return fmt.Errorf("exec exit %d: %v", code, err)
		}
	case <-ctx.Done():
		return ctx.Err()
	}
	return nil
}

// Remove deletes a container made by the runner (task killed first).
func (r *Runner) Remove(ctx context.Context, id string) error { return r.remove(ctx, id) }

func (r *Runner) remove(ctx context.Context, id string) error {
	ctr, err := r.Client.LoadContainer(ctx, id)
	if errdefs.IsNotFound(err) {
		return nil
	}
	if err != nil {
		return err
	}
	var errs []error
	if task, err := ctr.Task(ctx, nil); err == nil {
		_ = task.Kill(ctx, syscall.SIGKILL)
		if ch, err := task.Wait(ctx); err == nil {
			select {
			case <-ch:
			case <-time.After(10 * time.Second):
			}
		}
		if _, err := task.Delete(ctx, containerd.WithProcessKill); err != nil && !errdefs.IsNotFound(err) {
			errs = append(errs, err)
		}
	}
	if err := ctr.Delete(ctx, containerd.WithSnapshotCleanup); err != nil && !errdefs.IsNotFound(err) {
		errs = append(errs, err)
	}
	return errors.Join(errs...)
}

// memory reads a container's cgroup memory usage (v1 or v2).
func (r *Runner) memory(ctx context.Context, id string) (int64, error) {
	ctr, err := r.Client.LoadContainer(ctx, id)
	if err != nil {
		return 0, err
	}
	spec, err := ctr.Spec(ctx)
	if err != nil {
		return 0, err
	}
	p := spec.Linux.CgroupsPath
	for _, f := range []string{
		filepath.Join("/sys/fs/cgroup/memory", p, "memory.usage_in_bytes"),
		filepath.Join("/sys/fs/cgroup", p, "memory.current"),
	} {
		if b, err := os.ReadFile(f); err == nil {
			return strconv.ParseInt(strings.TrimSpace(string(b)), 10, 64)
		}
	}
	return 0, fmt.Errorf("no memory cgroup for %s at %s: %w", id, p, errdefs.ErrNotFound)
}

// waitLine waits for a line of a log starting with prefix and returns it.
func waitLine(ctx context.Context, path, prefix string) (string, error) {
	for {
		if b, err := os.ReadFile(path); err == nil {
			for _, l := range strings.Split(string(b), "\n") {
				if strings.HasPrefix(l, prefix) {
					return l, nil
				}
				if strings.HasPrefix(l, "Traceback ") {
					return "", fmt.Errorf("%s: the build container failed:\n%s", path, tailText(string(b), 800))
				}
			}
		}
		select {
		case <-ctx.Done():
			b, _ := os.ReadFile(path)
			return "", fmt.Errorf("%s: no line %q yet: %w\n%s", path, prefix, ctx.Err(), tailText(string(b), 800))
		case <-time.After(5 * time.Millisecond):
		}
	}
}

func tailText(s string, n int) string {
	if len(s) > n {
		return s[len(s)-n:]
	}
	return s
}
