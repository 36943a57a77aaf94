package client

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strings"

	containerd "github.com/containerd/containerd/v2/client"
	"github.com/containerd/containerd/v2/core/mount"
	"github.com/containerd/containerd/v2/pkg/namespaces"
	"github.com/containerd/errdefs"
	"github.com/containerd/log"

	"github.com/lazyfork/lazyfork/api"
	snapclient "github.com/lazyfork/lazyfork/snapshotter/client"
)

// CRI's labels on a pod's containers (set by kubelet), and CRI's own
// annotation of a container's pod namespace.
const (
	labelPodNamespace          = "io.kubernetes.pod.namespace"
	labelPodName               = "io.kubernetes.pod.name"
	labelContainer             = "io.kubernetes.container.name"
	annotationSandboxNamespace = "io.kubernetes.cri.sandbox-namespace"
)

// FailPodSnapshotMade is the failpoint (LAZYFORK_FAILPOINT) of SnapshotForPod
// once its snapshot is made, before it returns it to its caller.
const FailPodSnapshotMade = "pod-snapshot-made"

// SnapshotForPod serves a fork whose api.AnnotationForkOf names a running
// container: ref is its id, or NAMESPACE/POD/CONTAINER as Kubernetes names
// it, in the context's containerd namespace. For a fork in a pod of
// Kubernetes namespace podNS (podNS != ""), the parent must be in the same
// Kubernetes namespace and have opted in (api.AnnotationForkable=true),
// which is checked before anything is paused. The rest is SnapshotForRootfs,
// except that the snapshot directory keeps its operation marker: the caller
// (the fork's shim) claims it with node.KeepSnapshot once it recorded the
// directory as its container's, and until then it is an orphan to lazyfork
// gc (older than OrphanAge, no live operation). So a caller, or this
// process, that dies before the claim leaves nothing that GC does not take.
func (c *Client) SnapshotForPod(ctx context.Context, ref, upper, podNS string) (imageDir string, err error) {
	id, err := c.runningContainer(ctx, ref)
	if err != nil {
		return "", err
	}
	if podNS != "" {
		if err := c.podMayFork(ctx, id, podNS); err != nil {
			return "", err
		}
	}
	return c.snapshotForRootfs(ctx, id, upper, true)
}

// podMayFork checks that a pod of Kubernetes namespace podNS may fork
// container id: the parent's pod is in the same namespace and opted in with
// lazyfork.io/forkable=true (the shim checks the snapshot's record again).
func (c *Client) podMayFork(ctx context.Context, id, podNS string) error {
	ctr, err := c.cd.LoadContainer(ctx, id)
	if err != nil {
		return err
	}
	spec, err := ctr.Spec(ctx)
	if err != nil {
		return err
	}
	if got := spec.Annotations[annotationSandboxNamespace]; got != podNS {
		return fmt.Errorf("a pod of Kubernetes namespace %q cannot fork container %s of namespace %q: %w", podNS, id, got, errdefs.ErrPermissionDenied)
	}
	if spec.Annotations[api.AnnotationForkable] != "true" {
		return fmt.Errorf("container %s did not opt in to forks by pods (annotation %s=true on its pod): %w", id, api.AnnotationForkable, errdefs.ErrPermissionDenied)
	}
	return nil
}

// runningContainer resolves a container id, or NAMESPACE/POD/CONTAINER, to the
// id of a container of that name with a running task.
func (c *Client) runningContainer(ctx context.Context, ref string) (string, error) {
	parts := strings.Split(ref, "/")
	switch len(parts) {
	case 1:
		return ref, nil
	case 3:
	default:
		return "", fmt.Errorf("%q: want a container id or NAMESPACE/POD/CONTAINER: %w", ref, errdefs.ErrInvalidArgument)
	}
	filter := fmt.Sprintf(`labels.%q==%q,labels.%q==%q,labels.%q==%q`,
		labelPodNamespace, parts[0], labelPodName, parts[1], labelContainer, parts[2])
	ctrs, err := c.cd.Containers(ctx, filter)
	if err != nil {
		return "", err
	}
	var running []string
	for _, ctr := range ctrs {
		t, err := ctr.Task(ctx, nil)
		if err != nil {
			continue
		}
		if st, err := t.Status(ctx); err == nil && st.Status == containerd.Running {
			running = append(running, ctr.ID())
		}
	}
	switch len(running) {
	case 1:
		return running[0], nil
	case 0:
		return "", fmt.Errorf("no running container %s in pod %s/%s (%d by that name): %w", parts[2], parts[0], parts[1], len(ctrs), errdefs.ErrNotFound)
	}
	return "", fmt.Errorf("%d running containers %s in pod %s/%s: %w", len(running), parts[2], parts[0], parts[1], errdefs.ErrFailedPrecondition)
}

// SnapshotForRootfs snapshots the running container id, as Checkpoint does,
// for one fork whose root filesystem was prepared elsewhere from the parent's
// image (a pod's container, prepared by CRI): it copies the parent's writable
// layer into upper, the upper directory of that root filesystem, and returns
// the snapshot's image directory. The snapshot no longer needs the parent's
// layer; it keeps its own memory-file reference until RemoveSnapshot.
func (c *Client) SnapshotForRootfs(ctx context.Context, id, upper string) (imageDir string, retErr error) {
	return c.snapshotForRootfs(ctx, id, upper, false)
}

// snapshotForRootfs is SnapshotForRootfs; claimable leaves the snapshot
// unclaimed (see SnapshotForPod).
func (c *Client) snapshotForRootfs(ctx context.Context, id, upper string, claimable bool) (imageDir string, retErr error) {
	if st, err := os.Stat(upper); err != nil || !st.IsDir() {
		return "", fmt.Errorf("the fork's upper directory %s: %w", upper, errdefs.ErrInvalidArgument)
	}
	res, err := c.fork(ctx, id, 0, KeepSnapshot(), func(cfg *forkConfig) { cfg.claimable = claimable })
	if err != nil {
		return "", err
	}
	imageDir = res.Snapshot
	defer func() {
		if retErr != nil {
			if err := c.RemoveSnapshot(context.WithoutCancel(ctx), imageDir); err != nil {
				log.G(ctx).WithError(err).WithField("snapshot", imageDir).Warn("lazyfork: remove snapshot")
			}
		}
	}()
	snapDir := filepath.Dir(imageDir)
	snap, err := c.node.Snapshot(ctx, imageDir)
	if err != nil {
		return "", err
	}
	rfs := snap.Rootfs
	if rfs == nil {
		return "", fmt.Errorf("snapshot %s has no rootfs record: %w", imageDir, errdefs.ErrNotFound)
	}
	if err := c.CopySnapshotLayer(ctx, imageDir, upper); err != nil {
		return "", err
	}
	// The layer lives in the fork now.
	if rfs.Frozen != "" {
		c.releaseFrozen(ctx, rfs.Frozen)
	}
	// Removing the record also renews the directory's time, from which an
	// unclaimed snapshot's OrphanAge counts.
	if err := c.node.ReleaseRootfs(ctx, snapDir); err != nil {
		return "", err
	}
	if claimable {
		if err := failpoint(ctx, FailPodSnapshotMade); err != nil {
			return "", err
		}
	}
	return imageDir, nil
}

// CopySnapshotLayer copies the parent's writable layer that the snapshot at
// imageDir recorded (its upper copy, or its frozen layer with the frozen
// layers it stacks on, as one layer) into upper, the upper directory of a
// fork's root filesystem made elsewhere (a pod's). The snapshot keeps its
// layer for other forks.
func (c *Client) CopySnapshotLayer(ctx context.Context, imageDir, upper string) error {
	if st, err := os.Stat(upper); err != nil || !st.IsDir() {
		return fmt.Errorf("the fork's upper directory %s: %w", upper, errdefs.ErrInvalidArgument)
	}
	snap, err := c.node.Snapshot(ctx, filepath.Clean(imageDir))
	if err != nil {
		return err
	}
	rfs := snap.Rootfs
	if rfs == nil {
		return fmt.Errorf("snapshot %s has no rootfs record: %w", imageDir, errdefs.ErrNotFound)
	}
	if rfs.Frozen != "" && rfs.Snapshotter == "" {
		return fmt.Errorf("snapshot %s does not record where its frozen layer %s is (taken by an older LazyFork): %w", imageDir, rfs.Frozen, errdefs.ErrNotImplemented)
	}
	layers, release, err := c.recordedLayers(ctx, rfs)
	if err != nil {
		return err
	}
	defer release()
	for _, l := range layers {
		if err := mergeLayer(upper, l); err != nil {
			return fmt.Errorf("copy the snapshot's writable layer into the fork's: %w", err)
		}
	}
	return nil
}

// recordedLayers are the directories holding the writable layer a
// snapshot's rootfs record names, bottom first: its copy of the upper
// directory, or, from a read-only view of its frozen layer (release removes
// the view), that layer's directory and those of the frozen layers it stacks
// on. A fork of a fork on LazyFork's snapshotter stacks on its parent's
// frozen layer, so its own frozen layer holds only what it wrote: the files
// its parent (and theirs) wrote before are in the layers below, down to the
// first that is no frozen layer (the image's).
func (c *Client) recordedLayers(ctx context.Context, rfs *api.RootfsRecord) (layers []string, release func(), err error) {
	if rfs.Frozen == "" {
		if rfs.UpperCopy == "" {
			return nil, func() {}, nil
		}
		return []string{rfs.UpperCopy}, func() {}, nil
	}
	if rfs.Namespace != "" {
		ctx = namespaces.WithNamespace(ctx, rfs.Namespace)
	}
	sn := c.cd.SnapshotService(rfs.Snapshotter)
	n := 0
	for key := rfs.Frozen; key != ""; n++ {
		info, err := sn.Stat(ctx, key)
		if err != nil {
			return nil, nil, fmt.Errorf("frozen layer %s: %w", key, err)
		}
		if _, ok := info.Labels[snapclient.FrozenFromLabel]; !ok && key != rfs.Frozen {
			break
		}
		key = info.Parent
	}
	view := "lazyfork-view-" + randomHex(6)
	mounts, err := sn.View(ctx, view, rfs.Frozen)
	if err != nil {
		return nil, nil, fmt.Errorf("view frozen layer %s: %w", rfs.Frozen, err)
	}
	release = func() {
		if err := sn.Remove(context.WithoutCancel(ctx), view); err != nil && !errdefs.IsNotFound(err) {
			log.G(ctx).WithError(err).WithField("view", view).Warn("lazyfork: remove view")
		}
	}
	dirs, err := viewLayers(mounts)
	if err == nil && len(dirs) < n {
		err = fmt.Errorf("view mounts %v show %d layers, fewer than the %d frozen layers: %w", mounts, len(dirs), n, errdefs.ErrFailedPrecondition)
	}
	if err != nil {
		release()
		return nil, nil, fmt.Errorf("frozen layer %s: %w", rfs.Frozen, err)
	}
	for i := n - 1; i >= 0; i-- {
		layers = append(layers, dirs[i])
	}
	return layers, release, nil
}

// viewLayers are the directories of a read-only view's layers, top first:
// an overlay's lowerdirs, or the source of a single bind mount.
func viewLayers(mounts []mount.Mount) ([]string, error) {
	if len(mounts) == 1 {
		m := mounts[0]
		for _, o := range m.Options {
			if v, ok := strings.CutPrefix(o, "lowerdir="); ok {
				return strings.Split(v, ":"), nil
			}
		}
		if m.Type == "bind" || m.Type == "rbind" {
			return []string{m.Source}, nil
		}
	}
	return nil, fmt.Errorf("view mounts %v have no layer directory: %w", mounts, errdefs.ErrNotImplemented)
}

// topLayer is the directory of the topmost layer of a read-only view: the
// first lowerdir of an overlay, or the source of a single bind mount.
func topLayer(mounts []mount.Mount) (string, error) {
	if len(mounts) == 1 {
		m := mounts[0]
		for _, o := range m.Options {
			if v, ok := strings.CutPrefix(o, "lowerdir="); ok {
				return strings.Split(v, ":")[0], nil
			}
		}
		if m.Type == "bind" || m.Type == "rbind" {
			return m.Source, nil
		}
	}
	return "", fmt.Errorf("view mounts %v have no layer directory: %w", mounts, errdefs.ErrNotImplemented)
}
