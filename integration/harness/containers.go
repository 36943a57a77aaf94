package harness

import (
	"bufio"
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"time"

	"github.com/containerd/containerd/api/types/runc/options"
	"github.com/containerd/containerd/v2/client"
	"github.com/containerd/containerd/v2/core/containers"
	"github.com/containerd/containerd/v2/pkg/cio"
	"github.com/containerd/containerd/v2/pkg/oci"
	"github.com/containerd/errdefs"
)

// RuncRuntime is the runtime NewContainer uses unless told otherwise.
const RuncRuntime = "io.containerd.runc.v2"

// ContainerConfig describes a container made by NewContainer.
type ContainerConfig struct {
	// Image is the container's image (required).
	Image client.Image
	// Args replace the image's command when set.
	Args []string
	// Runtime defaults to RuncRuntime.
	Runtime string
	// RuntimeOptions default to runc options with the harness's private runc root
	// (RuntimeOptions()); any runtime that accepts runc's options should keep them.
	RuntimeOptions any
	// Snapshotter defaults to containerd's default (overlayfs).
	Snapshotter string
	// SpecOpts are applied after the image config, args and cgroups path.
	SpecOpts []oci.SpecOpts
	// ContainerOpts are applied last.
	ContainerOpts []client.NewContainerOpts
}

// CgroupPath is the linux.cgroupsPath the harness gives container id.
func (c *Containerd) CgroupPath(id string) string {
	return c.CgroupParent + "/" + id
}

// RuntimeOptions returns runc options pointing at the harness's private runc root.
func (c *Containerd) RuntimeOptions() *options.Options {
	return &options.Options{Root: c.RuncRoot}
}

// TaskLogPath is the file that NewTask sends a container's stdout and stderr to.
func (c *Containerd) TaskLogPath(id string) string {
	return filepath.Join(c.Dir, "logs", id+".log")
}

// NewContainer creates container id from cfg, with its own snapshot (named id),
// cgroups path CgroupPath(id) and the private runc root.
func (c *Containerd) NewContainer(ctx context.Context, id string, cfg ContainerConfig) (client.Container, error) {
	if cfg.Image == nil {
		return nil, fmt.Errorf("harness: container %s: no image: %w", id, errdefs.ErrInvalidArgument)
	}
	ctx = c.Context(ctx)
	rt := cfg.Runtime
	if rt == "" {
		rt = RuncRuntime
	}
	var rtOpts any = c.RuntimeOptions()
	if cfg.RuntimeOptions != nil {
		rtOpts = cfg.RuntimeOptions
	}
	specOpts := []oci.SpecOpts{oci.WithImageConfig(cfg.Image)}
	if len(cfg.Args) > 0 {
		specOpts = append(specOpts, oci.WithProcessArgs(cfg.Args...))
	}
	specOpts = append(specOpts, oci.WithCgroup(c.CgroupPath(id)))
	specOpts = append(specOpts, cfg.SpecOpts...)
	opts := []client.NewContainerOpts{client.WithImage(cfg.Image)}
	if cfg.Snapshotter != "" {
		opts = append(opts, client.WithSnapshotter(cfg.Snapshotter))
	}
	opts = append(opts,
		client.WithNewSnapshot(id, cfg.Image),
		client.WithNewSpec(specOpts...),
		client.WithRuntime(rt, rtOpts),
	)
	opts = append(opts, cfg.ContainerOpts...)
	ctr, err := c.Client().NewContainer(ctx, id, opts...)
	if err != nil {
		return nil, fmt.Errorf("harness: new container %s: %w", id, err)
	}
	return ctr, nil
}

// CloneContainer creates container id as a copy of parent for a restore: same
// image, runtime (and options), snapshotter, labels and spec, but its own fresh
// snapshot of the image (named id) and its own cgroups path. The parent's rootfs
// must not have changed for a CRIU restore on the fresh snapshot to succeed.
func (c *Containerd) CloneContainer(ctx context.Context, parent client.Container, id string, extra ...client.NewContainerOpts) (client.Container, error) {
	ctx = c.Context(ctx)
	info, err := parent.Info(ctx)
	if err != nil {
		return nil, fmt.Errorf("harness: clone %s: %w", parent.ID(), err)
	}
	spec, err := parent.Spec(ctx)
	if err != nil {
		return nil, fmt.Errorf("harness: clone %s: spec: %w", parent.ID(), err)
	}
	if spec.Linux == nil {
		return nil, fmt.Errorf("harness: clone %s: spec has no linux section: %w", parent.ID(), errdefs.ErrInvalidArgument)
	}
	spec.Linux.CgroupsPath = c.CgroupPath(id)
	img, err := c.Client().GetImage(ctx, info.Image)
	if err != nil {
		return nil, fmt.Errorf("harness: clone %s: image %s: %w", parent.ID(), info.Image, err)
	}
	opts := []client.NewContainerOpts{
		client.WithImage(img),
		client.WithSnapshotter(info.Snapshotter),
		client.WithNewSnapshot(id, img),
		client.WithSpec(spec),
		client.WithContainerLabels(info.Labels),
	}
	if info.Runtime.Options != nil {
		opts = append(opts, func(_ context.Context, _ *client.Client, ci *containers.Container) error {
			ci.Runtime = info.Runtime
			return nil
		})
	} else {
		opts = append(opts, client.WithRuntime(info.Runtime.Name, nil))
	}
	opts = append(opts, extra...)
	ctr, err := c.Client().NewContainer(ctx, id, opts...)
	if err != nil {
		return nil, fmt.Errorf("harness: clone %s as %s: %w", parent.ID(), id, err)
	}
	return ctr, nil
}

// NewTask creates ctr's task with stdout and stderr appended to TaskLogPath(id).
// Pass client.WithRestoreImagePath(dir) to restore from a checkpoint directory.
func (c *Containerd) NewTask(ctx context.Context, ctr client.Container, opts ...client.NewTaskOpts) (client.Task, error) {
	ctx = c.Context(ctx)
	task, err := ctr.NewTask(ctx, cio.LogFile(c.TaskLogPath(ctr.ID())), opts...)
	if err != nil {
		return nil, fmt.Errorf("harness: new task %s: %w", ctr.ID(), err)
	}
	return task, nil
}

// StartTask is NewTask followed by Start; on a failed start the task is deleted.
func (c *Containerd) StartTask(ctx context.Context, ctr client.Container, opts ...client.NewTaskOpts) (client.Task, error) {
	ctx = c.Context(ctx)
	task, err := c.NewTask(ctx, ctr, opts...)
	if err != nil {
		return nil, err
	}
	if err := task.Start(ctx); err != nil {
		_, _ = task.Delete(ctx, client.WithProcessKill)
		return nil, fmt.Errorf("harness: start task %s: %w", ctr.ID(), err)
	}
	return task, nil
}

// ReadLines returns the complete lines of a log file so far.
func ReadLines(path string) ([]string, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	var lines []string
	sc := bufio.NewScanner(f)
	sc.Buffer(make([]byte, 64*1024), 16*1024*1024)
	for sc.Scan() {
		lines = append(lines, sc.Text())
	}
	return lines, sc.Err()
}

// WaitLine polls the log file at path until a line satisfies match, and returns
// it. skip lines at the start are ignored (pass a previous len(ReadLines) to wait
// only for new lines). It fails when ctx ends, with the log's tail in the error.
func WaitLine(ctx context.Context, path string, skip int, match func(string) bool) (string, error) {
	for {
		lines, _ := ReadLines(path)
		for i := skip; i < len(lines); i++ {
			if match(lines[i]) {
				return lines[i], nil
			}
		}
		select {
		case <-ctx.Done():
			tail := lines
			if len(tail) > 20 {
				tail = tail[len(tail)-20:]
			}
			return "", fmt.Errorf("harness: no matching line in %s (%w); last lines:\n%s", path, ctx.Err(), strings.Join(tail, "\n"))
		case <-time.After(10 * time.Millisecond):
		}
	}
}
