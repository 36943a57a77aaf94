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
	err := walkInfo(ctx, func(ctx context.Context, info snapshots.Info) error {
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
	syncDirName = "fs.sync"
)

func (s *Snapshotter) precopy(ctx context.Context, td, sourceID string) error {
	p, err := probeTime(filepath.Join(td, freezeProbe))
	if err != nil {
		return err
	}
	st, err := CopyLayer(ctx, filepath.Join(td, "fs"), s.upperPath(sourceID), withLive())
	if err != nil {
		return err
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
	dir := filepath.Join(s.snapshotsDir(), id)
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

// removeStaleSyncs drops second-pass directories a crash left behind (the
// snapshot's fs is always whole: it is swapped in by RENAME_EXCHANGE).
func (s *Snapshotter) removeStaleSyncs(ctx context.Context) {
	matches, _ := filepath.Glob(filepath.Join(s.snapshotsDir(), "*", syncDirName))
	for _, m := range matches {
		if err := os.RemoveAll(m); err != nil {
			log.G(ctx).WithError(err).WithField("path", m).Warn("failed to remove stale freeze sync dir")
		}
	}
}
