package shim

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"time"

	"github.com/containerd/errdefs"

	"github.com/lazyfork/lazyfork/api"
	"github.com/lazyfork/lazyfork/memfile"
	"github.com/lazyfork/lazyfork/node"
)

// Who may fork whom (docs/security.md):
//
//   - A family belongs to the containerd namespace of the container that
//     started it (memfile.Owner). A container is restored from a snapshot only
//     if the snapshot's family belongs to its own namespace; its family is the
//     snapshot's, never one it names: a root always starts a family of its own.
//   - lazyfork.io/fork-of (what a pod author controls) may name only a
//     LazyFork snapshot directory under ROOT/snapshots, a checkpoint archive
//     in one of the configured archive directories, or a running container of
//     the same containerd namespace; for a Kubernetes pod the parent must be
//     in the pod's own Kubernetes namespace and have opted in
//     (lazyfork.io/forkable=true).
//   - A container sees at /.lazyfork/mem only the memory files its own memory
//     maps (memfile views), never the rest of its family's.

// A snapshot's source record (api.SourceFile, api.SnapshotSource) says whom
// it was taken of; authorizeRestore checks a fork-of against it.

func writeSource(imageDir string, src *api.SnapshotSource) error {
	b, err := json.Marshal(src)
	if err != nil {
		return err
	}
	return writeFileAtomic(filepath.Join(imageDir, api.SourceFile), b, 0o600)
}

// readSource returns an error wrapping errdefs.ErrNotFound when the image has
// no source record.
func readSource(imageDir string) (*api.SnapshotSource, error) {
	return api.ReadSnapshotSource(imageDir)
}

// forkable reads a container's opt-in annotation.
func forkable(ann map[string]string) bool { return ann[api.AnnotationForkable] == "true" }

// authorizeRestore decides whether a container of namespace ns with the
// given spec annotations may be restored from the snapshot at imageDir.
// byAnnotation says the snapshot was named by lazyfork.io/fork-of (which a
// pod author controls) rather than by a containerd client of ns.
func authorizeRestore(store *memfile.Store, ns string, ann map[string]string, byAnnotation bool, imageDir string, snap *memfile.SnapshotInfo) error {
	owner, err := store.Owner(snap.Family)
	if err != nil {
		if errdefs.IsNotFound(err) {
			return fmt.Errorf("snapshot %s: family %s has no owner on this host (its memory files are gone, or it was not made here; %s): %w",
				imageDir, snap.Family, hintFilesGone, errdefs.ErrPermissionDenied)
		}
		return fmt.Errorf("snapshot %s: owner of family %s: %w", imageDir, snap.Family, err)
	}
	if owner.Namespace != ns {
		return fmt.Errorf("snapshot %s belongs to containerd namespace %q; a container of namespace %q cannot be restored from it: %w",
			imageDir, owner.Namespace, ns, errdefs.ErrPermissionDenied)
	}
	if !byAnnotation {
		return nil
	}
	src, err := readSource(imageDir)
	if err != nil {
		if errdefs.IsNotFound(err) {
			return fmt.Errorf("annotation %s: %v (take it again with this LazyFork): %w", api.AnnotationForkOf, err, errdefs.ErrPermissionDenied)
		}
		return fmt.Errorf("annotation %s: %w", api.AnnotationForkOf, err)
	}
	if src.Namespace != ns || src.Family != snap.Family {
		return fmt.Errorf("annotation %s: snapshot %s was taken of %s/%s (family %s), not of this namespace %q: %w",
			api.AnnotationForkOf, imageDir, src.Namespace, src.Container, src.Family, ns, errdefs.ErrPermissionDenied)
	}
	if podNS := ann[annotationCRISandboxNamespace]; podNS != "" {
		if src.PodNamespace != podNS {
			return fmt.Errorf("annotation %s: a pod of Kubernetes namespace %q cannot fork container %s of namespace %q: %w",
				api.AnnotationForkOf, podNS, src.Container, src.PodNamespace, errdefs.ErrPermissionDenied)
		}
		if !src.Forkable {
			return fmt.Errorf("annotation %s: container %s did not opt in to forks by pods (annotation %s=true on its pod): %w",
				api.AnnotationForkOf, src.Container, api.AnnotationForkable, errdefs.ErrPermissionDenied)
		}
	}
	return nil
}

// checkForkOfPath allows an absolute lazyfork.io/fork-of only inside LazyFork's
// snapshot directory (a snapshot directory) or an archive directory (a
// checkpoint archive), after symlinks: a pod author must not make the shim
// read arbitrary host paths.
func (c Config) checkForkOfPath(ref string) error {
	real, err := filepath.EvalSymlinks(ref)
	if err != nil {
		return fmt.Errorf("annotation %s: %w: %w", api.AnnotationForkOf, err, errdefs.ErrNotFound)
	}
	fi, err := os.Stat(real)
	if err != nil {
		return fmt.Errorf("annotation %s: %w: %w", api.AnnotationForkOf, err, errdefs.ErrNotFound)
	}
	if fi.IsDir() {
		if within(real, api.Root(c.Root).Snapshots()) {
			return nil
		}
		return fmt.Errorf("annotation %s=%q: a snapshot directory must be under %s: %w",
			api.AnnotationForkOf, ref, api.Root(c.Root).Snapshots(), errdefs.ErrPermissionDenied)
	}
	for _, d := range c.ArchiveDirs {
		if dreal, err := filepath.EvalSymlinks(d); err == nil && within(real, dreal) {
			return nil
		}
	}
	return fmt.Errorf("annotation %s=%q: a checkpoint archive must be in one of %v (the shim's LAZYFORK_ARCHIVE_DIRS): %w",
		api.AnnotationForkOf, ref, c.ArchiveDirs, errdefs.ErrPermissionDenied)
}

// A snapshot directory a fork-of makes for its container (an archive
// unpacked, or a snapshot of a running container made by the node API's
// SnapshotForPod) is born unclaimed: it holds an operation marker
// (node.OpMarker) that no journal record names, so lazyfork gc removes it,
// and its reference on the family's memory files, once it is older than
// client.OrphanAge. The shim claims it (removes the marker) only after the
// container's state records it, from when the container's release removes
// it. A shim or lazyfork-snapshotter that dies in between leaves GC's work,
// never an owner-less snapshot.

// markUnclaimed marks snapshot directory dir unclaimed.
func markUnclaimed(dir string) error {
	return os.WriteFile(filepath.Join(dir, node.OpMarker), []byte(node.UnclaimedOp+"\n"), 0o600)
}

// claimSnapshot claims the fork-of snapshot directory dir ("" for none) for
// the container whose state records it.
func claimSnapshot(cfg Config, dir string) error {
	if dir == "" {
		return nil
	}
	if err := node.NewLocal(cfg.Root).KeepSnapshot(context.Background(), dir); err != nil {
		return fmt.Errorf("claim fork-of snapshot %s: %w", dir, err)
	}
	return nil
}

// within reports whether path lies strictly inside dir (both clean, absolute).
func within(path, dir string) bool {
	rel, err := filepath.Rel(dir, path)
	return err == nil && rel != "." && rel != ".." && !strings.HasPrefix(rel, "../") && !filepath.IsAbs(rel)
}

// claimRootFamily starts the family of a root container: its id, or, if a
// container of another namespace already owns that name, its id with a
// suffix of its namespace's hash. A family is never shared across
// namespaces. The container's reference (holder, tied to its task's bundle)
// is recorded with the claim, so that no GC finds the family empty before
// the container's view exists.
func claimRootFamily(store *memfile.Store, ns, id, holder, bundle string) (string, error) {
	sum := sha256.Sum256([]byte(ns))
	var errs []error
	for _, family := range []string{id, id + "-" + hex.EncodeToString(sum[:4])} {
		err := store.ClaimHeld(family, memfile.Owner{Namespace: ns, Root: id, Created: time.Now().UTC()}, holder, bundle)
		if err == nil {
			return family, nil
		}
		if !errdefs.IsAlreadyExists(err) {
			return "", fmt.Errorf("start family %s: %w", family, err)
		}
		errs = append(errs, err)
	}
	return "", fmt.Errorf("start a family for %s/%s: %w", ns, id, errors.Join(errs...))
}
