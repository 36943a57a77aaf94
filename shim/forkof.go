package shim

import (
	"archive/tar"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"os"
	"path"
	"path/filepath"
	"strings"
	"time"

	"github.com/containerd/containerd/v2/core/mount"
	"github.com/containerd/containerd/v2/pkg/archive"
	"github.com/containerd/containerd/v2/pkg/archive/compression"
	"github.com/containerd/errdefs"
	"golang.org/x/sys/unix"

	"github.com/lazyfork/lazyfork/api"
	"github.com/lazyfork/lazyfork/internal/ckptarchive"
	"github.com/lazyfork/lazyfork/memfile"
	"github.com/lazyfork/lazyfork/node"
)

// Limits on an archive's checkpoint entries: the image of a LazyFork snapshot
// is small (its memory lives in the family's files; what stays in the image is
// a fork's delta, at most a quarter of its shared pages before a rebase), so
// anything far larger is refused rather than filling the tmpfs. The total is
// also bounded by the space the tmpfs has, less a reserve for running forks.
const (
	maxArchiveTotal = 4 << 30
	archiveReserve  = 256 << 20
)

// forkOf returns the fork-of reference that applies to a container with these
// annotations: never to a pod's sandbox container, and with
// lazyfork.io/fork-container only to the container of that name.
func forkOf(a map[string]string) string {
	ref := a[api.AnnotationForkOf]
	if ref == "" || a[annotationCRIContainerType] == "sandbox" {
		return ""
	}
	if want := a[api.AnnotationForkContainer]; want != "" && a[annotationCRIContainerName] != want {
		return ""
	}
	return ref
}

// resolveForkOf turns the value of the lazyfork.io/fork-of annotation into a
// LazyFork snapshot directory. A directory is used as it is; a regular file is
// taken for a checkpoint archive written by containerd's CRI (CheckpointContainer)
// and its checkpoint/ entries are unpacked into a fresh directory under
// ROOT/snapshots, which the caller owns (unpacked != "") and removes when the
// container goes. On error nothing is left behind.
func resolveForkOf(cfg Config, ns, id, ref string) (dir, unpacked string, retErr error) {
	if ref == "" || !filepath.IsAbs(ref) {
		return "", "", fmt.Errorf("annotation %s=%q: want an absolute path to a LazyFork snapshot directory or a checkpoint archive: %w", api.AnnotationForkOf, ref, errdefs.ErrInvalidArgument)
	}
	fi, err := os.Stat(ref)
	if err != nil {
		return "", "", fmt.Errorf("annotation %s: %w: %w", api.AnnotationForkOf, err, errdefs.ErrNotFound)
	}
	switch {
	case fi.IsDir():
		if _, err := memfile.ReadSnapshot(ref); err != nil {
			return "", "", fmt.Errorf("annotation %s: %w", api.AnnotationForkOf, err)
		}
		return ref, "", nil
	case fi.Mode().IsRegular():
	default:
		return "", "", fmt.Errorf("annotation %s: %s is neither a directory nor a file: %w", api.AnnotationForkOf, ref, errdefs.ErrInvalidArgument)
	}
	sum := sha256.Sum256([]byte(ns + "/" + id))
	base := api.Root(cfg.Root).Snapshots()
	if err := os.MkdirAll(base, 0o700); err != nil {
		return "", "", err
	}
	top, err := os.MkdirTemp(base, "pod-"+hex.EncodeToString(sum[:6])+"-")
	if err != nil {
		return "", "", err
	}
	defer func() {
		if retErr != nil {
			_ = os.RemoveAll(top)
		}
	}()
	// Unclaimed until the container's state records it (claimSnapshot):
	// lazyfork gc takes it if this shim dies before.
	if err := markUnclaimed(top); err != nil {
		return "", "", err
	}
	image := api.ImageDir(top)
	if err := os.Mkdir(image, 0o700); err != nil {
		return "", "", err
	}
	if err := unpackCheckpoint(ref, image); err != nil {
		return "", "", fmt.Errorf("annotation %s: checkpoint archive %s: %w", api.AnnotationForkOf, ref, err)
	}
	// lazyfork gc's UnclaimedAge counts from here, not from before the
	// unpack.
	now := time.Now()
	if err := os.Chtimes(top, now, now); err != nil {
		return "", "", err
	}
	if _, err := memfile.ReadSnapshot(image); err != nil {
		return "", "", fmt.Errorf("annotation %s: checkpoint archive %s holds no LazyFork snapshot: if it is a standard archive (lazyfork export, or a checkpoint taken under another runtime), import it with `lazyfork -n k8s.io import FILE` and name the imported snapshot in %s: %w", api.AnnotationForkOf, ref, api.AnnotationForkOf, err)
	}
	return image, top, nil
}

// unpackCheckpoint extracts the CRIU image (the regular files directly under
// checkpoint/) of a (possibly gzipped) checkpoint archive into dst, as
// untrusted input (ckptarchive.Unpack).
func unpackCheckpoint(archive, dst string) error {
	budget, err := archiveBudget(dst)
	if err != nil {
		return err
	}
	n, err := ckptarchive.Unpack(archive, dst, ckptarchive.Options{
		Budget: budget,
		NoSpace: func(entry string, size, budget int64) error {
			return fmt.Errorf("entry %q of %d bytes exceeds what is left of %d bytes for the whole image (tmpfs space less %d MiB kept for running forks, at most %d GiB): %w",
				entry, size, budget, archiveReserve>>20, maxArchiveTotal>>30, errdefs.ErrResourceExhausted)
		},
	})
	if err == nil && n == 0 {
		err = fmt.Errorf("no %s/ entries (not a containerd checkpoint archive): %w", ckptarchive.CheckpointDir, errdefs.ErrInvalidArgument)
	}
	return err
}

// archiveBudget is how many bytes an archive's image may take in dir: what
// its filesystem has free, less a reserve, at most maxArchiveTotal.
func archiveBudget(dir string) (int64, error) {
	var fs unix.Statfs_t
	if err := unix.Statfs(dir, &fs); err != nil {
		return 0, fmt.Errorf("statfs %s: %w", dir, err)
	}
	free := int64(fs.Bavail)*fs.Bsize - archiveReserve
	return max(0, min(free, maxArchiveTotal)), nil
}

// archiveRootfsDiff is the entry of containerd's CRI checkpoint archive that
// holds the container's writable layer as a (gzipped) layer tar.
const archiveRootfsDiff = "rootfs-diff.tar"

// applyRootfsDiff applies the writable layer recorded in a CRI checkpoint
// archive to a fork's fresh root filesystem, mounted for the purpose: the
// fork then sees the files its parent wrote and not those it deleted, and
// CRIU finds the files the dumped processes hold open. It reports whether
// the archive had a layer. The layer is untrusted input; containerd's layer
// applier keeps every path inside the root.
func applyRootfsDiff(ctx context.Context, archivePath string, rootfs []mount.Mount) (bool, error) {
	f, err := os.Open(archivePath)
	if err != nil {
		return false, err
	}
	defer f.Close()
	outer, err := compression.DecompressStream(f)
	if err != nil {
		return false, fmt.Errorf("%v: %w", err, errdefs.ErrInvalidArgument)
	}
	defer outer.Close()
	tr := tar.NewReader(outer)
	for {
		h, err := tr.Next()
		if errors.Is(err, io.EOF) {
			return false, nil
		}
		if err != nil {
			return false, fmt.Errorf("read: %v: %w", err, errdefs.ErrInvalidArgument)
		}
		if path.Clean(strings.TrimPrefix(h.Name, "./")) == archiveRootfsDiff && h.Typeflag == tar.TypeReg {
			break
		}
	}
	if len(rootfs) == 0 {
		return true, fmt.Errorf("the archive has a writable layer but the container has no rootfs mounts to apply it to: %w", errdefs.ErrFailedPrecondition)
	}
	layer, err := compression.DecompressStream(tr)
	if err != nil {
		return true, fmt.Errorf("%s: %v: %w", archiveRootfsDiff, err, errdefs.ErrInvalidArgument)
	}
	defer layer.Close()
	target, err := os.MkdirTemp("", "lazyfork-rootfs-")
	if err != nil {
		return true, err
	}
	defer os.Remove(target)
	if err := mount.All(rootfs, target); err != nil {
		return true, fmt.Errorf("mount the fork's rootfs: %w", err)
	}
	_, err = archive.Apply(ctx, target, layer)
	if uerr := mount.UnmountAll(target, 0); uerr != nil && err == nil {
		err = fmt.Errorf("unmount the fork's rootfs: %w", uerr)
	}
	if err != nil {
		return true, fmt.Errorf("%s: %w", archiveRootfsDiff, err)
	}
	return true, nil
}

// snapshotRunning serves a lazyfork.io/fork-of that names a running LazyFork
// container instead of a path: its id, or NAMESPACE/POD/CONTAINER as
// Kubernetes names it. The node API (lazyfork-snapshotter, node.ForkOf)
// snapshots it through the containerd that started this shim as `lazyfork
// checkpoint` does and copies the parent's writable layer into the fork's
// upper directory (client.SnapshotForPod there): the shim links no
// containerd client. The snapshot's directory under ROOT/snapshots belongs
// to the fork (unpacked) and goes with it, once claimed (claimSnapshot;
// until then lazyfork gc takes it); the parent keeps running. The
// lookup is in the fork's containerd namespace only; for a fork in a pod
// (podNS != "") the parent must be in the same Kubernetes namespace and
// opted in, which is checked before anything is paused, and
// authorizeRestore checks the snapshot's source record again.
func (s *Service) snapshotRunning(ctx context.Context, ns, ref, podNS string, rootfs []mount.Mount) (dir, unpacked string, retErr error) {
	upper, err := upperDirOf(rootfs)
	if err != nil {
		return "", "", fmt.Errorf("annotation %s=%q: %w", api.AnnotationForkOf, ref, err)
	}
	var image string
	err = s.withForkOf(ns, func(n *node.Remote, fc node.ForkOfContext) error {
		image, err = n.SnapshotForPod(ctx, node.PodSnapshot{ForkOfContext: fc, Ref: ref, Upper: upper, PodNamespace: podNS})
		return err
	})
	if err != nil {
		return "", "", fmt.Errorf("annotation %s=%q: %w", api.AnnotationForkOf, ref, err)
	}
	if filepath.Dir(filepath.Dir(image)) != api.Root(s.cfg.Root).Snapshots() {
		return "", "", fmt.Errorf("annotation %s=%q: the snapshot %q is not under %s: %w", api.AnnotationForkOf, ref, image, api.Root(s.cfg.Root).Snapshots(), errdefs.ErrInternal)
	}
	return image, filepath.Dir(image), nil
}

// copySnapshotLayer gives a fork from a kept snapshot directory (one that
// recorded its parent's writable layer: api.RootfsFile beside it) that layer,
// copied by the node API (node.ForkOf, client.CopySnapshotLayer there). A
// snapshot without the record leaves the rootfs as CRI made it.
func (s *Service) copySnapshotLayer(ctx context.Context, ns, imageDir string, rootfs []mount.Mount) (bool, error) {
	if _, err := os.Stat(filepath.Join(filepath.Dir(imageDir), api.RootfsFile)); err != nil {
		return false, nil
	}
	upper, err := upperDirOf(rootfs)
	if err != nil {
		return true, err
	}
	return true, s.withForkOf(ns, func(n *node.Remote, fc node.ForkOfContext) error {
		return n.CopySnapshotLayer(ctx, node.PodLayer{ForkOfContext: fc, ImageDir: imageDir, Upper: upper})
	})
}

// withForkOf runs f with the node API (nodeAPISocket) and what a fork-of
// call needs to name: the containerd that started this shim (GRPC_ADDRESS,
// which containerd gives every shim), containerd namespace ns and this
// shim's LazyFork root. The connection lasts for the call: only a fork-of
// of a running container or a kept snapshot needs one; closing it cancels
// a call the shim gave up on.
func (s *Service) withForkOf(ns string, f func(*node.Remote, node.ForkOfContext) error) error {
	addr := os.Getenv("GRPC_ADDRESS")
	if addr == "" {
		return fmt.Errorf("the shim does not know containerd's address (GRPC_ADDRESS): %w", errdefs.ErrFailedPrecondition)
	}
	n := node.NewRemote(nodeAPISocket(s.cfg.Root))
	defer n.Close()
	return f(n, node.ForkOfContext{Containerd: addr, Namespace: ns, Root: s.cfg.Root})
}

// nodeAPISocket is where the shim asks the node API for a fork-of: $LAZYFORK_API,
// else the socket lazyfork setup serves for root (api.Root.APISocket), as
// the CLI finds it.
func nodeAPISocket(root string) string {
	if v := os.Getenv("LAZYFORK_API"); v != "" {
		return v
	}
	return api.Root(root).APISocket()
}

// upperDirOf finds the upper directory of a fork's overlay rootfs.
func upperDirOf(rootfs []mount.Mount) (string, error) {
	for _, m := range rootfs {
		for _, o := range m.Options {
			if v, ok := strings.CutPrefix(o, "upperdir="); ok {
				return v, nil
			}
		}
	}
	return "", fmt.Errorf("the fork's rootfs %v has no overlay upper directory for its parent's layer: %w", rootfs, errdefs.ErrNotImplemented)
}
