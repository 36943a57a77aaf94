//go:build linux

package snapshotter

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"github.com/containerd/containerd/v2/core/mount"
	"github.com/containerd/containerd/v2/core/snapshots"
	"github.com/containerd/containerd/v2/core/snapshots/storage"
	"github.com/containerd/errdefs"
	"github.com/containerd/log"
	"golang.org/x/sys/unix"

	"github.com/lazyfork/lazyfork/snapshotter/client"
)

// FreezeSourceLabel on a Prepare names the active snapshot whose upper dir
// becomes the new snapshot's layer. It has containerd's snapshot label prefix
// so that containerd passes it on to a proxy snapshotter. Its value is the key
// as the caller knows it: the exact backend key, or, through containerd, the
// key inside the caller's namespace (backend keys are "<ns>/<n>/<key>").
const FreezeSourceLabel = client.FreezeSourceLabel

// resolveFreezeSource finds the active snapshot a freeze copies and checks
// that the new snapshot will have the same parent, so that the frozen layer
// stacks exactly where the active's upper dir stacked.
func (s *Snapshotter) resolveFreezeSource(ctx context.Context, newKey, source, parent string) (key, id string, err error) {
	if source == "" {
		return "", "", fmt.Errorf("empty %s: %w", FreezeSourceLabel, errdefs.ErrInvalidArgument)
	}
	var info snapshots.Info
	err = s.ms.WithTransaction(ctx, false, func(ctx context.Context) error {
		key = source
		if _, _, _, err := storage.GetInfo(ctx, source); err != nil {
			if !errdefs.IsNotFound(err) {
				return err
			}
			key, err = findNamespacedKey(ctx, newKey, source)
			if err != nil {
				return err
			}
		}
		var err error
		id, info, _, err = storage.GetInfo(ctx, key)
		return err
	})
	if err != nil {
		return "", "", fmt.Errorf("freeze source %q: %w", source, err)
	}
	if info.Kind != snapshots.KindActive {
		return "", "", fmt.Errorf("freeze source %q is %v, not an active snapshot: %w", source, info.Kind, errdefs.ErrInvalidArgument)
	}
	if info.Parent != parent {
		return "", "", fmt.Errorf("freeze of %q must be prepared on its parent %q, not %q: %w", source, info.Parent, parent, errdefs.ErrInvalidArgument)
	}
	return key, id, nil
}

// findNamespacedKey maps a key the way containerd's metadata store names it
// in the backend ("<ns>/<n>/<key>") using the namespace of newKey, which
// containerd named the same way.
func findNamespacedKey(ctx context.Context, newKey, source string) (string, error) {
	ns, _, ok := strings.Cut(newKey, "/")
	if !ok {
		return "", fmt.Errorf("no snapshot %q: %w", source, errdefs.ErrNotFound)
	}
	// Backend snapshots outlive their containerd record until containerd's
	// GC runs, so a deleted and recreated key can appear twice. containerd
	// numbers its snapshots from a growing sequence and a key is unique
	// among its live snapshots, so the newest is the live one.
	var (
		found string
		best  uint64
	)
	err := storage.WalkInfo(ctx, func(ctx context.Context, info snapshots.Info) error {
		if info.Kind != snapshots.KindActive {
			return nil
		}
		rest, ok := strings.CutPrefix(info.Name, ns+"/")
		if !ok {
			return nil
		}
		n, k, ok := strings.Cut(rest, "/")
		if !ok || k != source {
			return nil
		}
		seq, err := strconv.ParseUint(n, 10, 64)
		if err != nil {
			return nil
		}
		if found == "" || seq > best {
			found, best = info.Name, seq
		}
		return nil
	})
	if err != nil {
		return "", err
	}
	if found == "" {
		return "", fmt.Errorf("no active snapshot %q in namespace %q: %w", source, ns, errdefs.ErrNotFound)
	}
	return found, nil
}

// Freeze makes the frozen layer frozenName from the active snapshot
// activeKey in process (see client.Freeze, which does the same through
// containerd).
func (s *Snapshotter) Freeze(ctx context.Context, activeKey, frozenName string, opts ...snapshots.Opt) (snapshots.Info, error) {
	return client.Freeze(ctx, s, activeKey, frozenName, opts...)
}

// A freeze runs in two passes so that the task using the source stays frozen
// only for what changed:
//
//  1. Prepare (task running): copy the source's upper dir as it is, after
//     creating the probe file freezeProbe; its ctime P is the filesystem's
//     clock when the copy began. Each file is fsynced before it is read.
//  2. Commit (task frozen): walk the source again into fs.sync; a regular
//     file whose ctime is before P has not changed since pass 1 copied it
//     and is hard-linked from that copy, anything else is copied afresh.
//     fs.sync and fs are then exchanged atomically (RENAME_EXCHANGE).
//
// ctime is the one time a process cannot set: every write, every fault on a
// clean shared page (hence the fsync in pass 1), chmod, chown, xattr change,
// link, unlink and rename moves it to the current time. A clock stepped back
// between the passes would defeat that; then pass 2 copies everything.
const (
	freezeProbe = "freeze-probe"
	preDirName  = "fs.pre"
	syncDirName = "fs.sync"
)

// freezeSource reads FreezeSourceLabel from a Prepare's or View's options.
func freezeSource(opts []snapshots.Opt) (source string, ok bool, err error) {
	var base snapshots.Info
	for _, o := range opts {
		if err := o(&base); err != nil {
			return "", false, err
		}
	}
	source, ok = base.Labels[FreezeSourceLabel]
	return source, ok, nil
}

// prepareFreeze is pass 1. The overlay snapshotter records the snapshot
// (with an empty layer, in the transaction that checks the source is still
// there); the copy then runs outside any transaction, other calls carrying
// on, into fs.pre beside that layer, which replaces the empty one only once
// it is whole. A snapshot directory is owned by its record, so no sweep
// touches the copy. After a crash mid-copy the layer is still empty (the
// next start removes fs.pre) and a Commit would copy everything in pass 2.
func (s *Snapshotter) prepareFreeze(ctx context.Context, key, parent, source string, opts []snapshots.Opt) (_ []mount.Mount, err error) {
	s.freezes.RLock()
	defer s.freezes.RUnlock()
	sourceKey, sourceID, err := s.resolveFreezeSource(ctx, key, source, parent)
	if err != nil {
		return nil, err
	}
	sameSource := func(ctx context.Context) error {
		id, _, _, err := storage.GetInfo(ctx, sourceKey)
		if err != nil || id != sourceID {
			return fmt.Errorf("freeze source %q went away during the copy: %w", source, errdefs.ErrNotFound)
		}
		return nil
	}
	mounts, err := s.overlaySnapshotter.Prepare(withTxCheck(ctx, sameSource), key, parent, opts...)
	if err != nil {
		return nil, err
	}
	defer func() {
		if err == nil {
			return
		}
		// A fresh context: the caller's may be what failed.
		rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 30*time.Second)
		defer cancel()
		if rerr := s.overlaySnapshotter.Remove(rctx, key); rerr != nil {
			log.G(ctx).WithError(rerr).WithField("key", key).Warn("failed to remove the snapshot of a failed freeze")
		}
	}()
	id, _, err := s.info(ctx, key)
	if err != nil {
		return nil, err
	}
	s.building.Add(1)
	defer s.building.Add(-1)
	if err := s.precopy(ctx, s.snapshotDir(id), sourceID); err != nil {
		return nil, fmt.Errorf("freeze %q into %q: %w", source, key, err)
	}
	// The source may have been removed while we copied.
	if err := s.ms.WithTransaction(ctx, false, sameSource); err != nil {
		return nil, err
	}
	return mounts, nil
}

// testHookPrecopy is called as a freeze's first pass starts copying into dir.
var testHookPrecopy = func(dir string) {}

func (s *Snapshotter) precopy(ctx context.Context, dir, sourceID string) error {
	pre := filepath.Join(dir, preDirName)
	if err := os.Mkdir(pre, 0o755); err != nil {
		return err
	}
	defer os.RemoveAll(pre) // gone already once it is the layer
	p, err := probeTime(filepath.Join(dir, freezeProbe))
	if err != nil {
		return err
	}
	testHookPrecopy(dir)
	st, err := CopyLayer(ctx, pre, s.upperPath(sourceID), withLive())
	if err != nil {
		return err
	}
	// Replaces the empty layer the overlay snapshotter made (rename(2)
	// replaces an empty directory; os.Rename refuses to).
	if err := unix.Rename(pre, filepath.Join(dir, "fs")); err != nil {
		return &os.LinkError{Op: "rename", Old: pre, New: filepath.Join(dir, "fs"), Err: err}
	}
	log.G(ctx).WithField("files", st.Files).WithField("bytes", st.Bytes).WithField("reflinked", st.Reflinked).
		WithField("vanished", st.Vanished).WithField("duration", st.Duration).WithField("probe", p).Debug("freeze: first pass")
	return nil
}

// probeTime creates path and returns its ctime: the filesystem's clock now.
func probeTime(path string) (unix.Timespec, error) {
	f, err := os.OpenFile(path, os.O_WRONLY|os.O_CREATE|os.O_TRUNC, 0o600)
	if err != nil {
		return unix.Timespec{}, err
	}
	f.Close()
	var st unix.Stat_t
	if err := unix.Stat(path, &st); err != nil {
		return unix.Timespec{}, &os.PathError{Op: "stat", Path: path, Err: err}
	}
	return st.Ctim, nil
}

func (s *Snapshotter) syncFreeze(ctx context.Context, key, id, source, parent string) error {
	_, sourceID, err := s.resolveFreezeSource(ctx, key, source, parent)
	if err != nil {
		return err
	}
	dir := s.snapshotDir(id)
	syncDir := filepath.Join(dir, syncDirName)
	if err := os.RemoveAll(syncDir); err != nil {
		return err
	}
	if err := os.Mkdir(syncDir, 0o755); err != nil {
		return err
	}
	defer os.RemoveAll(syncDir)

	var opts []CopyOption
	var st unix.Stat_t
	if err := unix.Stat(filepath.Join(dir, freezeProbe), &st); err == nil {
		now, err := probeTime(filepath.Join(syncDir, ".now"))
		if err != nil {
			return err
		}
		os.Remove(filepath.Join(syncDir, ".now"))
		if tsBefore(now, st.Ctim) {
			log.G(ctx).WithField("key", key).Warn("freeze: the clock went back since the first pass; copying everything")
		} else {
			opts = append(opts, withReuse(filepath.Join(dir, "fs"), st.Ctim))
		}
	}
	cs, err := CopyLayer(ctx, syncDir, s.upperPath(sourceID), opts...)
	if err != nil {
		return err
	}
	if err := unix.Renameat2(unix.AT_FDCWD, syncDir, unix.AT_FDCWD, filepath.Join(dir, "fs"), unix.RENAME_EXCHANGE); err != nil {
		return &os.LinkError{Op: "rename exchange", Old: syncDir, New: filepath.Join(dir, "fs"), Err: err}
	}
	if err := os.Remove(filepath.Join(dir, freezeProbe)); err != nil && !errors.Is(err, os.ErrNotExist) {
		return err
	}
	log.G(ctx).WithField("files", cs.Files).WithField("reused", cs.Reused).WithField("copied", cs.Copied).
		WithField("reflinked", cs.Reflinked).WithField("duration", cs.Duration).Debug("freeze: second pass")
	return nil
}

// removeStaleFreezeDirs drops the copies a crash left behind in either pass
// (the snapshot's fs is always whole: pass 1 renames its copy in, pass 2
// swaps it in by RENAME_EXCHANGE).
func (s *Snapshotter) removeStaleFreezeDirs(ctx context.Context) {
	pre, _ := filepath.Glob(filepath.Join(s.snapshotsDir(), "*", preDirName))
	sync, _ := filepath.Glob(filepath.Join(s.snapshotsDir(), "*", syncDirName))
	for _, m := range append(pre, sync...) {
		if err := os.RemoveAll(m); err != nil {
			log.G(ctx).WithError(err).WithField("path", m).Warn("failed to remove stale freeze sync dir")
		}
	}
}
