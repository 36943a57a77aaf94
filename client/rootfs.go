package client

import (
	"context"
	"fmt"
	"os"
	"strings"

	"github.com/containerd/containerd/v2/core/mount"
	"github.com/containerd/continuity/fs"
	"github.com/containerd/errdefs"

	"github.com/lazyfork/lazyfork/api"
)

// upperDir is the writable directory of an active snapshot.
func (c *Client) upperDir(ctx context.Context, snapshotter, key string) (string, error) {
	mounts, err := c.cd.SnapshotService(snapshotter).Mounts(ctx, key)
	if err != nil {
		return "", fmt.Errorf("mounts of snapshot %s: %w", key, err)
	}
	return upperOf(mounts)
}

// upperOf finds the writable directory in a snapshot's mounts: overlay's
// upperdir, or the source of a single read-write bind mount (a snapshot without
// parents).
func upperOf(mounts []mount.Mount) (string, error) {
	if len(mounts) == 1 {
		m := mounts[0]
		for _, o := range m.Options {
			if v, ok := strings.CutPrefix(o, "upperdir="); ok {
				return v, nil
			}
		}
		if m.Type == "bind" || m.Type == "rbind" {
			ro := false
			for _, o := range m.Options {
				ro = ro || o == "ro"
			}
			if !ro {
				return m.Source, nil
			}
		}
	}
	return "", fmt.Errorf("rootfs mounts %v have no writable upper directory (an overlay-style snapshotter is needed until LazyFork's snapshotter): %w", mounts, errdefs.ErrNotImplemented)
}

// copyLayer copies a writable layer, keeping owners, modes, times, xattrs
// (overlay's opaque markers), device nodes (overlay's whiteouts) and hard links.
func copyLayer(dst, src string) error {
	if err := os.MkdirAll(dst, 0o755); err != nil {
		return err
	}
	return fs.CopyDir(dst, src)
}

// gcRootLabel keeps a frozen layer from containerd's garbage collector while a
// kept snapshot may still restore forks on it.
const gcRootLabel = "containerd.io/gc.root"

// rootfsSource is where a snapshot's forks get the parent's writable layer
// (api.RootfsFile in the snapshot directory).
type rootfsSource = api.RootfsRecord
