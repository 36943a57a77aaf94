package client

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"

	"github.com/containerd/containerd/v2/core/containers"
	"github.com/containerd/containerd/v2/core/leases"
	"github.com/containerd/containerd/v2/core/mount"
	"github.com/containerd/containerd/v2/core/snapshots"
	"github.com/containerd/errdefs"
	"github.com/containerd/log"
	"golang.org/x/sys/unix"

	"github.com/lazyfork/lazyfork/api"
)

// batchLayerLabel marks a batch layer: a committed snapshot holding a
// snapshot's copy of its parent's writable layer (rootfsSource.UpperCopy),
// stacked where that layer stacked, on which a batch of forks stack their
// fresh uppers. It is the frozen layer of a snapshotter that has none, made
// once per batch through the ordinary snapshot API instead of copying the
// layer into every fork's upper. Its value is the operation's snapshot
// directory's image (for people reading `ctr snapshots ls`).
const batchLayerLabel = api.Prefix + "batch-layer"

// forkBase is the snapshot a batch's forks stack on: the frozen layer, or,
// for a copy of the parent's layer, a batch layer made here (remove, not
// nil then, removes it: for a batch that failed, once its forks are gone).
// The batch layer is made under ctx's lease, which keeps it until the forks'
// snapshots, its children, do; containerd's GC removes it after the last.
//
// reuse (a snapshot restored again) takes a batch layer an earlier batch of
// the snapshot made, if its forks still hold it: making one copies the layer
// and commits it, about 10 ms of a restore call.
func (c *Client) forkBase(ctx context.Context, info containers.Container, imageDir string, rfs *rootfsSource, reuse bool) (base string, remove func(context.Context), err error) {
	if rfs.Frozen != "" {
		return rfs.Frozen, nil, nil
	}
	sn := c.cd.SnapshotService(info.Snapshotter)
	pinfo, err := sn.Stat(ctx, info.SnapshotKey)
	if err != nil {
		return "", nil, fmt.Errorf("parent snapshot: %w", err)
	}
	base, err = belowBatchLayer(ctx, sn, pinfo.Parent)
	if err != nil {
		return "", nil, err
	}
	if empty, err := dirEmpty(rfs.UpperCopy); err != nil {
		return "", nil, fmt.Errorf("the snapshot's copy of the writable layer: %w", err)
	} else if empty {
		return base, nil, nil
	}
	if reuse {
		if name := c.keptBatchLayer(ctx, sn, info.Snapshotter, imageDir, base); name != "" {
			return name, nil, nil
		}
	}
	name := "lazyfork-batch-" + randomHex(8)
	tmp := name + "-prepare"
	labels := snapshots.WithLabels(map[string]string{batchLayerLabel: imageDir})
	mounts, err := sn.Prepare(ctx, tmp, base, labels)
	if err != nil {
		return "", nil, fmt.Errorf("prepare the batch's layer: %w", err)
	}
	commit := func() error {
		upper, err := upperOf(mounts)
		if err != nil {
			return err
		}
		if err := copyLayer(upper, rfs.UpperCopy); err != nil {
			return fmt.Errorf("copy writable layer: %w", err)
		}
		return sn.Commit(ctx, name, tmp, labels)
	}
	if err := commit(); err != nil {
		if rerr := sn.Remove(context.WithoutCancel(ctx), tmp); rerr != nil && !errdefs.IsNotFound(rerr) {
			log.G(ctx).WithError(rerr).WithField("key", tmp).Warn("lazyfork: remove batch layer (the operation's lease frees it)")
		}
		return "", nil, fmt.Errorf("batch layer: %w", err)
	}
	return name, func(ctx context.Context) {
		if err := sn.Remove(ctx, name); err != nil && !errdefs.IsNotFound(err) {
			log.G(ctx).WithError(err).WithField("key", name).Warn("lazyfork: remove batch layer (the operation's lease frees it)")
		}
	}, nil
}

// keptBatchLayer is a committed batch layer of imageDir stacked on base
// that this call's lease (ctx's) now holds, "" if there is none (or it went
// before the lease took it).
func (c *Client) keptBatchLayer(ctx context.Context, sn snapshots.Snapshotter, snapshotter, imageDir, base string) string {
	lease, ok := leases.FromContext(ctx)
	if !ok {
		return ""
	}
	var found string
	err := sn.Walk(ctx, func(_ context.Context, i snapshots.Info) error {
		if found == "" && i.Kind == snapshots.KindCommitted && i.Parent == base { // the filter has its label
			found = i.Name
		}
		return nil
	}, fmt.Sprintf("labels.%q==%q", batchLayerLabel, imageDir))
	if err != nil || found == "" {
		return ""
	}
	// Held by the lease first, then seen still there: containerd's GC
	// cannot take it from under this batch's forks.
	res := leases.Resource{ID: found, Type: "snapshots/" + snapshotter}
	if err := c.cd.LeasesService().AddResource(ctx, leases.Lease{ID: lease}, res); err != nil {
		return ""
	}
	if _, err := sn.Stat(ctx, found); err != nil {
		_ = c.cd.LeasesService().DeleteResource(ctx, leases.Lease{ID: lease}, res)
		return ""
	}
	return found
}

// belowBatchLayer is the snapshot under key when key is a batch layer, else
// key: a snapshot's copy of a fork's writable layer holds the batch layer's
// contents too (see batchLayerDir), so its forks stack where that layer did.
func belowBatchLayer(ctx context.Context, sn snapshots.Snapshotter, key string) (string, error) {
	if key == "" {
		return "", nil
	}
	info, err := sn.Stat(ctx, key)
	if err != nil {
		return "", fmt.Errorf("parent snapshot's base %s: %w", key, err)
	}
	if _, ok := info.Labels[batchLayerLabel]; ok {
		return info.Parent, nil
	}
	return key, nil
}

// batchLayerDir is, for a container whose rootfs stacks on a batch layer
// (a fork), a read-only view's directory of that layer, which release
// removes; "" otherwise.
func (c *Client) batchLayerDir(ctx context.Context, info containers.Container) (dir string, release func(), err error) {
	sn := c.cd.SnapshotService(info.Snapshotter)
	si, err := sn.Stat(ctx, info.SnapshotKey)
	if err != nil {
		return "", nil, fmt.Errorf("snapshot %s: %w", info.SnapshotKey, err)
	}
	if si.Parent == "" {
		return "", func() {}, nil
	}
	pi, err := sn.Stat(ctx, si.Parent)
	if err != nil {
		return "", nil, fmt.Errorf("snapshot %s: %w", si.Parent, err)
	}
	if _, ok := pi.Labels[batchLayerLabel]; !ok {
		return "", func() {}, nil
	}
	view := "lazyfork-view-" + randomHex(6)
	mounts, err := sn.View(ctx, view, si.Parent)
	if err != nil {
		return "", nil, fmt.Errorf("view batch layer %s: %w", si.Parent, err)
	}
	release = func() {
		if err := sn.Remove(context.WithoutCancel(ctx), view); err != nil && !errdefs.IsNotFound(err) {
			log.G(ctx).WithError(err).WithField("view", view).Warn("lazyfork: remove view")
		}
	}
	if dir, err = topLayer(mounts); err != nil {
		release()
		return "", nil, fmt.Errorf("batch layer %s: %w", si.Parent, err)
	}
	return dir, release, nil
}

// copyLayers copies the overlay layer upper, as seen on top of lower (""
// for none), into dst as one layer: lower's entries, then upper's over them,
// where a whiteout, an opaque directory or a non-directory of upper replaces
// whatever lower had at its path.
func copyLayers(dst, lower, upper string) error {
	if lower != "" {
		if err := copyLayer(dst, lower); err != nil {
			return err
		}
	}
	return mergeLayer(dst, upper)
}

// mergeLayer copies the overlay layer upper over the layer in dst (made by
// copyLayer or mergeLayer; absent or empty for none), so that dst holds the
// two as one layer: upper's whiteouts, opaque directories and non-directories
// replace whatever dst had at their paths, and directories merge.
func mergeLayer(dst, upper string) error {
	if empty, err := dirEmpty(dst); errors.Is(err, os.ErrNotExist) || err == nil && empty {
		return copyLayer(dst, upper)
	} else if err != nil {
		return err
	}
	err := filepath.WalkDir(upper, func(p string, d os.DirEntry, err error) error {
		if err != nil {
			return err
		}
		rel, err := filepath.Rel(upper, p)
		if err != nil || rel == "." {
			return err
		}
		target := filepath.Join(dst, rel)
		st, err := os.Lstat(target)
		if errors.Is(err, os.ErrNotExist) {
			if d.IsDir() {
				return filepath.SkipDir // copied whole below
			}
			return nil
		}
		if err != nil {
			return err
		}
		if d.IsDir() && st.IsDir() && !opaqueDir(p) {
			return nil // merged: its entries are looked at in turn
		}
		if err := os.RemoveAll(target); err != nil {
			return err
		}
		if d.IsDir() {
			return filepath.SkipDir
		}
		return nil
	})
	if err != nil {
		return fmt.Errorf("merge %s over %s: %w", upper, dst, err)
	}
	// Whatever upper has is now absent from dst or a directory to merge into.
	return copyLayer(dst, upper)
}

// opaqueDir tells whether overlay directory p hides the layers below it.
func opaqueDir(p string) bool {
	for _, name := range []string{"trusted.overlay.opaque", "user.overlay.opaque"} {
		buf := make([]byte, 4)
		n, err := unix.Lgetxattr(p, name, buf)
		if err == nil && n == 1 && buf[0] == 'y' {
			return true
		}
	}
	return false
}

// isOverlay tells whether a snapshot's mounts are an overlay with an upper
// directory (whose whiteouts and opaque directories say what it hides below).
func isOverlay(mounts []mount.Mount) bool {
	if len(mounts) != 1 {
		return false
	}
	for _, o := range mounts[0].Options {
		if strings.HasPrefix(o, "upperdir=") {
			return true
		}
	}
	return false
}

// dirEmpty tells whether directory dir has no entries.
func dirEmpty(dir string) (bool, error) {
	f, err := os.Open(dir)
	if err != nil {
		return false, err
	}
	defer f.Close()
	if _, err := f.Readdirnames(1); err == io.EOF {
		return true, nil
	} else if err != nil {
		return false, err
	}
	return false, nil
}
