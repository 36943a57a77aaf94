package client

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"syscall"

	containerd "github.com/containerd/containerd/v2/client"
	"github.com/containerd/containerd/v2/pkg/namespaces"
	"github.com/containerd/errdefs"
	"github.com/containerd/log"

	"github.com/lazyfork/lazyfork/api"
	"github.com/lazyfork/lazyfork/node"
)

// Checkpoint takes a LazyFork snapshot of a running container and keeps it
// (Result.Snapshot); the container keeps running. RestoreForks restores forks
// from it, RemoveSnapshot deletes it.
func (c *Client) Checkpoint(ctx context.Context, id string) (*Result, error) {
	return c.fork(ctx, id, 0, KeepSnapshot())
}

// Stop snapshots a running container, then ends its task: the container holds
// no process memory and stays forkable from the snapshot (Fork restores from
// it). The task stays frozen from the snapshot to its end, so it does nothing
// its forks will do again. It returns the snapshot's image directory.
func (c *Client) Stop(ctx context.Context, id string) (string, error) {
	ctr, err := c.cd.LoadContainer(ctx, id)
	if err != nil {
		return "", fmt.Errorf("stop %s: %w", id, err)
	}
	labels, err := ctr.Labels(ctx)
	if err != nil {
		return "", err
	}
	if labels[api.LabelStopped] != "" {
		return "", fmt.Errorf("stop %s: already stopped: %w", id, errdefs.ErrFailedPrecondition)
	}
	// The task stays frozen from its snapshot to its end: it never runs past
	// the state its forks restore. A failed stop leaves it as it was.
	var running bool
	if task, err := ctr.Task(ctx, nil); err == nil {
		if st, err := task.Status(ctx); err == nil {
			running = st.Status == containerd.Running
		}
	}
	thaw := func() {
		if !running {
			return
		}
		if task, err := ctr.Task(ctx, nil); err == nil {
			if st, err := task.Status(ctx); err == nil && st.Status == containerd.Paused {
				_ = task.Resume(context.WithoutCancel(ctx))
			}
		}
	}
	res, err := c.fork(ctx, id, 0, KeepSnapshot(), stayPaused())
	if err != nil {
		thaw()
		return "", fmt.Errorf("stop %s: %w", id, err)
	}
	if _, err := ctr.SetLabels(ctx, map[string]string{api.LabelStopped: res.Snapshot}); err != nil {
		_ = c.RemoveSnapshot(context.WithoutCancel(ctx), res.Snapshot)
		thaw()
		return "", fmt.Errorf("stop %s: record snapshot: %w", id, err)
	}
	if err := deleteTask(ctx, ctr); err != nil {
		return res.Snapshot, fmt.Errorf("stop %s: end task: %w", id, err)
	}
	return res.Snapshot, nil
}

// deleteTask kills a container's task (SIGKILL: a restored init ignores
// SIGTERM) and deletes it; no task is fine.
func deleteTask(ctx context.Context, ctr containerd.Container) error {
	task, err := ctr.Task(ctx, nil)
	if errdefs.IsNotFound(err) {
		return nil
	}
	if err != nil {
		return err
	}
	if st, err := task.Status(ctx); err == nil && st.Status == containerd.Paused {
		// Killed while frozen, it dies as it thaws, without running on.
		_ = task.Kill(ctx, syscall.SIGKILL, containerd.WithKillAll)
		_ = task.Resume(ctx)
	}
	_, err = task.Delete(ctx, containerd.WithProcessKill)
	if err != nil && !errdefs.IsNotFound(err) {
		_ = task.Kill(ctx, syscall.SIGKILL)
		_, err = task.Delete(ctx, containerd.WithProcessKill)
	}
	if errdefs.IsNotFound(err) {
		return nil
	}
	return err
}

// Delete ends a container's task, removes the snapshot Stop kept, its hook
// directory and the container with its rootfs. Its forks keep running: they
// hold their own references on the family's memory files.
func (c *Client) Delete(ctx context.Context, id string) error {
	ctr, err := c.cd.LoadContainer(ctx, id)
	if err != nil {
		return fmt.Errorf("delete %s: %w", id, err)
	}
	labels, err := ctr.Labels(ctx)
	if err != nil {
		return err
	}
	if err := deleteTask(ctx, ctr); err != nil {
		return fmt.Errorf("delete %s: task: %w", id, err)
	}
	var errs []error
	if snap, err := c.stoppedSnapshot(ctx, id, labels); err != nil {
		log.G(ctx).WithError(err).Warn("lazyfork: left the snapshot its label names")
	} else if snap != "" {
		if err := c.RemoveSnapshot(ctx, snap); err != nil {
			errs = append(errs, err)
		}
	}
	if err := ctr.Delete(ctx, containerd.WithSnapshotCleanup); err != nil && !errdefs.IsNotFound(err) {
		errs = append(errs, err)
	} else if err := removeNerdctlState(id, labels); err != nil {
		// nerdctl's state of its container goes as with nerdctl rm.
		log.G(ctx).WithError(err).Warn("lazyfork: remove nerdctl state")
	}
	if dir := labels[api.LabelHook]; dir != "" {
		if err := os.RemoveAll(filepath.Join(dir, id)); err != nil {
			log.G(ctx).WithError(err).Warn("lazyfork: remove hook dir")
		}
	}
	if ns, ok := namespaces.Namespace(ctx); ok && len(errs) == 0 {
		// A fork of it in flight keeps its lock; gc takes it later.
		if _, err := c.node.RemoveLock(ctx, node.ParentLock(ns, id)); err != nil {
			log.G(ctx).WithError(err).Debug("lazyfork: remove lock")
		}
	}
	if err := errors.Join(errs...); err != nil {
		return fmt.Errorf("delete %s: %w", id, err)
	}
	return nil
}

// Resolve finds the container a user means: an exact id, then a name
// (api.LabelName, or nerdctl's LabelNerdctlName), then a unique id prefix.
func (c *Client) Resolve(ctx context.Context, ref string) (string, error) {
	if ref == "" {
		return "", fmt.Errorf("empty container name: %w", errdefs.ErrInvalidArgument)
	}
	ctrs, err := c.cd.Containers(ctx)
	if err != nil {
		return "", err
	}
	var byName, byPrefix []string
	for _, ctr := range ctrs {
		if ctr.ID() == ref {
			return ref, nil
		}
		info, err := ctr.Info(ctx, containerd.WithoutRefreshedMetadata)
		if err != nil {
			continue
		}
		if info.Labels[api.LabelName] == ref || info.Labels[LabelNerdctlName] == ref {
			byName = append(byName, ctr.ID())
		}
		if strings.HasPrefix(ctr.ID(), ref) {
			byPrefix = append(byPrefix, ctr.ID())
		}
	}
	for _, m := range [][]string{byName, byPrefix} {
		switch len(m) {
		case 0:
			continue
		case 1:
			return m[0], nil
		default:
			sort.Strings(m)
			return "", fmt.Errorf("%q is ambiguous: it matches %s: %w", ref, strings.Join(m, ", "), errdefs.ErrInvalidArgument)
		}
	}
	return "", fmt.Errorf("no container named %q (no id, name or id prefix matches): %w", ref, errdefs.ErrNotFound)
}

// stoppedSnapshot is the snapshot container id's lazyfork.io/stopped label
// names, "" if none, and an error if the snapshot is not that container's
// own. Labels are not LazyFork's alone to write: CRI copies an image's
// labels onto its containers, so an image could name another container's
// snapshot there, to be forked or removed on its behalf.
func (c *Client) stoppedSnapshot(ctx context.Context, id string, labels map[string]string) (string, error) {
	snap := labels[api.LabelStopped]
	if snap == "" {
		return "", nil
	}
	ns, err := namespaces.NamespaceRequired(ctx)
	if err != nil {
		return "", err
	}
	s, err := c.node.Snapshot(ctx, snap)
	if err != nil {
		return "", fmt.Errorf("label %s of %s: %w", api.LabelStopped, id, err)
	}
	if s.SourceNamespace != ns || s.SourceContainer != id {
		return "", fmt.Errorf("label %s of %s names %s, a snapshot of %s/%s, not of this container: %w",
			api.LabelStopped, id, snap, s.SourceNamespace, s.SourceContainer, errdefs.ErrPermissionDenied)
	}
	return snap, nil
}
