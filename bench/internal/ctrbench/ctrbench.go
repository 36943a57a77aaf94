// Package ctrbench is the container side of LazyFork's benchmarks: a private
// containerd (integration/harness) with the python test image, counter
// containers (integration/workloads/counter.py), leave-running checkpoints to an
// image directory, restores of many copies at once with per-copy timing of
// "task create -> running", and each copy's cgroup memory.
//
// The plain runc/CRIU baseline (bench/baseline) and the LazyFork fork benchmarks
// use the same Env, Counter and measurement functions, so their figures come
// from one run on the same parent and can be printed side by side.
package ctrbench

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"sync"
	"time"

	tasksapi "github.com/containerd/containerd/api/services/tasks/v1"
	"github.com/containerd/containerd/api/types/runc/options"
	"github.com/containerd/containerd/v2/client"
	"github.com/containerd/errdefs"
	"github.com/containerd/typeurl/v2"

	lfclient "github.com/lazyfork/lazyfork/client"
	"github.com/lazyfork/lazyfork/integration/harness"
	"github.com/lazyfork/lazyfork/integration/workloads"
	"github.com/lazyfork/lazyfork/internal/cgroupmem"
)

// Env is a private containerd with the python test image imported.
type Env struct {
	H   *harness.Containerd
	Img client.Image
	// Root is the private LazyFork root of SetupLazyFork ("" for Setup).
	Root string
}

// Setup starts a private containerd with opts and imports the python image
// (unpacked into snapshotter, "" for the default).
func Setup(ctx context.Context, opts harness.Options, snapshotter string) (*Env, error) {
	h, err := harness.Start(ctx, opts)
	if err != nil {
		return nil, err
	}
	var iopts []harness.ImportOpt
	if snapshotter != "" {
		iopts = append(iopts, harness.WithSnapshotter(snapshotter))
	}
	img, err := h.ImportImage(ctx, "python", iopts...)
	if err != nil {
		_ = h.Stop()
		return nil, err
	}
	return &Env{H: h, Img: img}, nil
}

// SetupLazyFork is Setup for LazyFork's benchmarks: the shims (from bin) use
// a private LazyFork root (a tmpfs they mount), and lf is a LazyFork client
// on it. Close removes the root too.
func SetupLazyFork(ctx context.Context, bin string) (_ *Env, lf *lfclient.Client, retErr error) {
	return SetupLazyForkWith(ctx, bin, harness.Options{})
}

// SetupLazyForkWith is SetupLazyFork with harness options (e.g. Debug, or
// more environment for the shims) and the LazyFork client's options.
func SetupLazyForkWith(ctx context.Context, bin string, opts harness.Options, lfOpts ...lfclient.Opt) (_ *Env, lf *lfclient.Client, retErr error) {
	root, err := os.MkdirTemp("/tmp", "lfb-")
	if err != nil {
		return nil, nil, err
	}
	opts.BinDirs = append(opts.BinDirs, bin)
	opts.Env = append(opts.Env, "LAZYFORK_ROOT="+root)
	e, err := Setup(ctx, opts, "")
	if err != nil {
		return nil, nil, errors.Join(err, harness.RemoveLazyForkRoot(root))
	}
	e.Root = root
	return e, lfclient.New(e.H.Client(), append([]lfclient.Opt{lfclient.WithRoot(root)}, lfOpts...)...), nil
}

// Close tears the containerd and everything in it down, and the LazyFork
// root of SetupLazyFork.
func (e *Env) Close() error {
	err := e.H.Stop()
	if e.Root != "" {
		err = errors.Join(err, harness.RemoveLazyForkRoot(e.Root))
	}
	return err
}

// Counter is a running container whose task runs counter.py.
type Counter struct {
	ID        string
	Container client.Container
	Task      client.Task
	Log       string // the task's log file
}

// StartCounter creates and starts container id running counter.py with a heap of
// heapMiB, and waits until it is filled and counting. cfg may set the runtime,
// snapshotter, spec options...; Image and Args default to the python image and
// the counter.
func (e *Env) StartCounter(ctx context.Context, id string, heapMiB int, cfg harness.ContainerConfig) (*Counter, error) {
	ctx = e.H.Context(ctx)
	if cfg.Image == nil {
		cfg.Image = e.Img
	}
	if len(cfg.Args) == 0 {
		cfg.Args = workloads.CounterArgs(heapMiB)
	}
	ctr, err := e.H.NewContainer(ctx, id, cfg)
	if err != nil {
		return nil, err
	}
	task, err := e.H.StartTask(ctx, ctr)
	if err != nil {
		return nil, err
	}
	c := &Counter{ID: id, Container: ctr, Task: task, Log: e.H.TaskLogPath(id)}
	if _, err := workloads.WaitReady(ctx, c.Log); err != nil {
		return c, err
	}
	if _, err := workloads.WaitTickAbove(ctx, c.Log, 1); err != nil {
		return c, err
	}
	return c, nil
}

// Memory is the cgroup memory usage of container id (v1 usage_in_bytes, v2
// memory.current).
func (e *Env) Memory(id string) (int64, error) {
	return cgroupmem.Usage(e.H.CgroupPath(id))
}

// Remove kills and deletes c's task, then c's container and snapshot.
func (e *Env) Remove(ctx context.Context, c *Counter) error {
	ctx = e.H.Context(ctx)
	var errs []error
	if c.Task != nil {
		if _, err := c.Task.Delete(ctx, client.WithProcessKill); err != nil && !errdefs.IsNotFound(err) {
			errs = append(errs, err)
		}
	}
	if c.Container != nil {
		if err := c.Container.Delete(ctx, client.WithSnapshotCleanup); err != nil && !errdefs.IsNotFound(err) {
			errs = append(errs, err)
		}
	}
	return errors.Join(errs...)
}

// Checkpoint checkpoints task with runc's options as they are (Exit=false:
// leave running) into dir and returns how long the client's call took (it
// pauses the task, dumps, resumes).
func Checkpoint(ctx context.Context, task client.Task, dir string) (time.Duration, error) {
	opt := func(r *client.CheckpointTaskInfo) error {
		r.Options = &options.CheckpointOptions{Exit: false, ImagePath: dir}
		return nil
	}
	start := time.Now()
	if _, err := task.Checkpoint(ctx, opt); err != nil {
		return 0, fmt.Errorf("ctrbench: checkpoint: %w", err)
	}
	return time.Since(start), nil
}

// PausedCheckpoint is a plain runc checkpoint as LazyFork's snapshots are
// timed: the task paused, dumped into dir (leave running), resumed; it
// returns how long the task was paused.
func PausedCheckpoint(ctx context.Context, cl *client.Client, c *Counter, dir string) (time.Duration, error) {
	opts, err := typeurl.MarshalAnyToProto(&options.CheckpointOptions{ImagePath: dir})
	if err != nil {
		return 0, err
	}
	t0 := time.Now()
	if err := c.Task.Pause(ctx); err != nil {
		return 0, err
	}
	_, cerr := cl.TaskService().Checkpoint(ctx, &tasksapi.CheckpointTaskRequest{ContainerID: c.ID, Options: opts})
	rerr := c.Task.Resume(ctx)
	return time.Since(t0), errors.Join(cerr, rerr)
}

// ImageSize sums the sizes of the files under dir, and of the pages-*.img
// files among them (the memory CRIU wrote).
func ImageSize(dir string) (total, pages int64, err error) {
	err = filepath.WalkDir(dir, func(p string, d fs.DirEntry, err error) error {
		if err != nil || d.IsDir() {
			return err
		}
		info, err := d.Info()
		if err != nil {
			return err
		}
		total += info.Size()
		if m, _ := filepath.Match("pages-*.img", d.Name()); m {
			pages += info.Size()
		}
		return nil
	})
	return total, pages, err
}

// Copy is a container restored (or forked) from a checkpoint.
type Copy struct {
	Counter
	// Restore is task create -> running: Create (NewTask, which for runc only
	// records the checkpoint) plus Run (Start, where runc restore runs CRIU).
	Restore time.Duration
	Create  time.Duration
	Run     time.Duration
	// FirstTick is the first tick the copy printed.
	FirstTick int
}

// Concurrent runs f(0..n-1) at once and returns each call's duration and the wall
// time from the first start to the last end. All calls run even if some fail.
func Concurrent(n int, f func(i int) error) ([]time.Duration, time.Duration, error) {
	each := make([]time.Duration, n)
	errs := make([]error, n)
	var wg sync.WaitGroup
	gate := make(chan struct{})
	for i := 0; i < n; i++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			<-gate
			t := time.Now()
			errs[i] = f(i)
			each[i] = time.Since(t)
		}()
	}
	start := time.Now()
	close(gate)
	wg.Wait()
	return each, time.Since(start), errors.Join(errs...)
}

// RestoreCopies makes n plain runc copies of parent from the checkpoint in
// imageDir: the containers (cloned spec with their own cgroups path, fresh
// snapshots) are created first, untimed; then all n tasks are created from the
// image directory and started at once, each timed from task create to running.
// Copies are named prefix-1..prefix-n. It waits for each copy's first tick.
func (e *Env) RestoreCopies(ctx context.Context, parent client.Container, imageDir, prefix string, n int) ([]*Copy, time.Duration, error) {
	ctx = e.H.Context(ctx)
	copies := make([]*Copy, n)
	for i := range copies {
		id := fmt.Sprintf("%s-%d", prefix, i+1)
		ctr, err := e.H.CloneContainer(ctx, parent, id)
		if err != nil {
			return copies[:i], 0, err
		}
		copies[i] = &Copy{Counter: Counter{ID: id, Container: ctr, Log: e.H.TaskLogPath(id)}}
	}
	each, wall, err := Concurrent(n, func(i int) error {
		c := copies[i]
		t0 := time.Now()
		task, err := e.H.NewTask(ctx, c.Container, client.WithRestoreImagePath(imageDir))
		if err != nil {
			return err
		}
		c.Task = task
		c.Create = time.Since(t0)
		if err := task.Start(ctx); err != nil {
			return fmt.Errorf("ctrbench: restore %s: %w", c.ID, err)
		}
		c.Run = time.Since(t0) - c.Create
		return nil
	})
	for i := range copies {
		copies[i].Restore = each[i]
	}
	if err != nil {
		return copies, wall, err
	}
	for _, c := range copies {
		first, err := workloads.FirstTick(ctx, c.Log)
		if err != nil {
			return copies, wall, fmt.Errorf("ctrbench: copy %s: %w", c.ID, err)
		}
		c.FirstTick = first
	}
	return copies, wall, nil
}
