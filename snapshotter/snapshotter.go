//go:build linux

package snapshotter

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/containerd/containerd/v2/core/mount"
	"github.com/containerd/containerd/v2/core/snapshots"
	"github.com/containerd/containerd/v2/core/snapshots/storage"
	"github.com/containerd/continuity/fs"
	"github.com/containerd/errdefs"
	"github.com/containerd/log"
	bolt "go.etcd.io/bbolt"
	"golang.org/x/sys/unix"
)

// Option configures a Snapshotter.
type Option func(*config) error

type config struct {
	mountOptions []string
	asyncRemove  bool
}

// WithMountOptions adds options to every overlay mount (not to bind mounts).
func WithMountOptions(opts ...string) Option {
	return func(c *config) error {
		c.mountOptions = append(c.mountOptions, opts...)
		return nil
	}
}

// WithAsyncRemove defers freeing the disk of removed snapshots to Cleanup
// (containerd's GC calls it after its removals).
func WithAsyncRemove() Option {
	return func(c *config) error {
		c.asyncRemove = true
		return nil
	}
}

// Snapshotter is an overlayfs snapshotter with frozen layers.
type Snapshotter struct {
	root        string
	ms          *storage.MetaStore
	options     []string
	asyncRemove bool

	// building holds the names of the new-* directories being built, from
	// before their mkdir until their rename or removal, so that no orphan
	// sweep removes them (see newDir); true for a freeze's copy.
	mu       sync.Mutex
	building map[string]bool // guarded by mu

	lock      *os.File // flock on root/lock, held until Close
	closeOnce sync.Once
	closeErr  error
}

var _ snapshots.Snapshotter = (*Snapshotter)(nil)
var _ snapshots.Cleaner = (*Snapshotter)(nil)

// New opens (or creates) a snapshotter rooted at root and reconciles the
// directories under it with its metadata: directories left by a crash are
// removed, records whose directory is gone are reported by Status.
func New(ctx context.Context, root string, opts ...Option) (*Snapshotter, error) {
	var c config
	for _, o := range opts {
		if err := o(&c); err != nil {
			return nil, err
		}
	}
	if err := os.MkdirAll(root, 0o700); err != nil {
		return nil, err
	}
	dtype, err := fs.SupportsDType(root)
	if err != nil {
		return nil, fmt.Errorf("check d_type support of %s: %w", root, err)
	}
	if !dtype {
		return nil, fmt.Errorf("%s does not support d_type, which overlayfs needs: %w", root, errdefs.ErrNotImplemented)
	}
	if err := os.Mkdir(filepath.Join(root, "snapshots"), 0o700); err != nil && !os.IsExist(err) {
		return nil, err
	}
	// bbolt would wait forever for a second process's lock: fail fast
	// with a clear error instead.
	lock, err := lockRoot(root)
	if err != nil {
		return nil, err
	}
	ms, err := storage.NewMetaStore(filepath.Join(root, "metadata.db"), func(o *bolt.Options) error {
		o.Timeout = 10 * time.Second
		return nil
	})
	if err != nil {
		lock.Close()
		return nil, fmt.Errorf("open metadata of %s: %w", root, err)
	}
	options := c.mountOptions
	if !hasOption(options, "index") && supportsIndex() {
		// index=on would tie every layer to the upper dir's file handles;
		// layers are shared by many mounts, so keep it off like containerd.
		options = append(options, "index=off")
	}
	s := &Snapshotter{
		root:        root,
		ms:          ms,
		options:     options,
		asyncRemove: c.asyncRemove,
		building:    map[string]bool{},
		lock:        lock,
	}
	if err := s.Cleanup(ctx); err != nil {
		s.Close()
		return nil, fmt.Errorf("reconcile %s on start: %w", root, err)
	}
	s.removeStaleSyncs(ctx)
	if missing, err := s.missingDirs(ctx); err != nil {
		s.Close()
		return nil, err
	} else {
		for _, m := range missing {
			log.G(ctx).WithField("key", m).Error("snapshot has no directory on disk; remove it")
		}
	}
	return s, nil
}

func lockRoot(root string) (*os.File, error) {
	f, err := os.OpenFile(filepath.Join(root, "lock"), os.O_RDWR|os.O_CREATE, 0o600)
	if err != nil {
		return nil, err
	}
	if err := unix.Flock(int(f.Fd()), unix.LOCK_EX|unix.LOCK_NB); err != nil {
		f.Close()
		if errors.Is(err, unix.EWOULDBLOCK) {
			return nil, fmt.Errorf("%s is in use by another snapshotter process: %w", root, errdefs.ErrUnavailable)
		}
		return nil, fmt.Errorf("lock %s: %w", root, err)
	}
	return f, nil
}

// Root is the directory the snapshotter keeps everything in.
func (s *Snapshotter) Root() string { return s.root }

func hasOption(options []string, key string) bool {
	for _, o := range options {
		if k, _, _ := strings.Cut(o, "="); k == key {
			return true
		}
	}
	return false
}

func supportsIndex() bool {
	_, err := os.Stat("/sys/module/overlay/parameters/index")
	return err == nil
}

func (s *Snapshotter) snapshotsDir() string { return filepath.Join(s.root, "snapshots") }
func (s *Snapshotter) upperPath(id string) string {
	return filepath.Join(s.root, "snapshots", id, "fs")
}
func (s *Snapshotter) workPath(id string) string {
	return filepath.Join(s.root, "snapshots", id, "work")
}

// Stat returns the info of an active or committed snapshot by key or name.
func (s *Snapshotter) Stat(ctx context.Context, key string) (info snapshots.Info, err error) {
	err = s.ms.WithTransaction(ctx, false, func(ctx context.Context) error {
		_, info, _, err = storage.GetInfo(ctx, key)
		return err
	})
	return info, err
}

// Update updates the labels of a snapshot.
func (s *Snapshotter) Update(ctx context.Context, info snapshots.Info, fieldpaths ...string) (out snapshots.Info, err error) {
	err = s.ms.WithTransaction(ctx, true, func(ctx context.Context) error {
		out, err = storage.UpdateInfo(ctx, info, fieldpaths...)
		return err
	})
	return out, err
}

// Usage scans an active snapshot's upper dir; committed ones answer from metadata.
func (s *Snapshotter) Usage(ctx context.Context, key string) (snapshots.Usage, error) {
	var (
		id    string
		info  snapshots.Info
		usage snapshots.Usage
	)
	if err := s.ms.WithTransaction(ctx, false, func(ctx context.Context) (err error) {
		id, info, usage, err = storage.GetInfo(ctx, key)
		return err
	}); err != nil {
		return snapshots.Usage{}, err
	}
	if info.Kind == snapshots.KindActive {
		du, err := fs.DiskUsage(ctx, s.upperPath(id))
		if err != nil {
			return snapshots.Usage{}, err
		}
		usage = snapshots.Usage(du)
	}
	return usage, nil
}

// Prepare creates an active snapshot on parent. With the label
// FreezeSourceLabel, its layer starts as a copy of that active snapshot's
// upper dir (see package doc).
func (s *Snapshotter) Prepare(ctx context.Context, key, parent string, opts ...snapshots.Opt) ([]mount.Mount, error) {
	return s.createSnapshot(ctx, snapshots.KindActive, key, parent, opts)
}

// View creates a read-only snapshot of parent.
func (s *Snapshotter) View(ctx context.Context, key, parent string, opts ...snapshots.Opt) ([]mount.Mount, error) {
	return s.createSnapshot(ctx, snapshots.KindView, key, parent, opts)
}

// Mounts returns the mounts of an active or view snapshot.
func (s *Snapshotter) Mounts(ctx context.Context, key string) ([]mount.Mount, error) {
	var snap storage.Snapshot
	if err := s.ms.WithTransaction(ctx, false, func(ctx context.Context) (err error) {
		snap, err = storage.GetSnapshot(ctx, key)
		if err != nil {
			return fmt.Errorf("mounts of %q: %w", key, err)
		}
		return nil
	}); err != nil {
		return nil, err
	}
	return s.mounts(snap), nil
}

// Commit turns the active snapshot key into the committed snapshot name.
func (s *Snapshotter) Commit(ctx context.Context, name, key string, opts ...snapshots.Opt) error {
	var (
		syncedID string
		info     snapshots.Info
	)
	if err := s.ms.WithTransaction(ctx, false, func(ctx context.Context) (err error) {
		syncedID, info, _, err = storage.GetInfo(ctx, key)
		return err
	}); err != nil {
		return err
	}
	if source, ok := info.Labels[FreezeSourceLabel]; ok && info.Kind == snapshots.KindActive {
		// Outside any transaction: other calls carry on meanwhile.
		if err := s.syncFreeze(ctx, key, syncedID, source, info.Parent); err != nil {
			return fmt.Errorf("commit freeze %q: %w", key, err)
		}
	}
	return s.ms.WithTransaction(ctx, true, func(ctx context.Context) error {
		id, info, _, err := storage.GetInfo(ctx, key)
		if err != nil {
			return err
		}
		if _, ok := info.Labels[FreezeSourceLabel]; ok && id != syncedID {
			return fmt.Errorf("commit %q: snapshot replaced during the freeze: %w", key, errdefs.ErrFailedPrecondition)
		}
		if info.Kind != snapshots.KindActive {
			return fmt.Errorf("commit %q: snapshot is %v, not active: %w", key, info.Kind, errdefs.ErrFailedPrecondition)
		}
		du, err := fs.DiskUsage(ctx, s.upperPath(id))
		if err != nil {
			return fmt.Errorf("commit %q: usage: %w", key, err)
		}
		if _, err := storage.CommitActive(ctx, key, name, snapshots.Usage(du), opts...); err != nil {
			return fmt.Errorf("commit %q as %q: %w", key, name, err)
		}
		return nil
	})
}

// Remove forgets a snapshot; it fails with ErrFailedPrecondition while other
// snapshots stack on it, which is what keeps frozen layers alive.
func (s *Snapshotter) Remove(ctx context.Context, key string) (err error) {
	var removals []string
	// Directories go only after the transaction has committed: a crash in
	// between leaves an orphan directory that Cleanup removes, never a record
	// without its directory.
	defer func() {
		if err == nil {
			s.removeAll(ctx, removals)
		}
	}()
	return s.ms.WithTransaction(ctx, true, func(ctx context.Context) error {
		if _, _, err := storage.Remove(ctx, key); err != nil {
			return fmt.Errorf("remove snapshot %q: %w", key, err)
		}
		if !s.asyncRemove {
			removals, err = s.orphanDirs(ctx)
			return err
		}
		return nil
	})
}

// Walk calls fn for every snapshot matching the filters.
func (s *Snapshotter) Walk(ctx context.Context, fn snapshots.WalkFunc, filters ...string) error {
	return s.ms.WithTransaction(ctx, false, func(ctx context.Context) error {
		return walkInfo(ctx, fn, filters...)
	})
}

// Cleanup removes every directory under root/snapshots that the metadata does
// not know (removed snapshots, crash leftovers), except those being built.
func (s *Snapshotter) Cleanup(ctx context.Context) error {
	var dirs []string
	if err := s.ms.WithTransaction(ctx, true, func(ctx context.Context) (err error) {
		dirs, err = s.orphanDirs(ctx)
		return err
	}); err != nil {
		return err
	}
	s.removeAll(ctx, dirs)
	return nil
}

func (s *Snapshotter) removeAll(ctx context.Context, dirs []string) {
	for _, d := range dirs {
		if err := os.RemoveAll(d); err != nil {
			log.G(ctx).WithError(err).WithField("path", d).Warn("failed to remove snapshot directory")
		}
	}
}

// orphanDirs lists the directories under root/snapshots that no snapshot
// owns and no live call is building. It must run inside a write transaction
// so that no snapshot is recorded while it compares.
func (s *Snapshotter) orphanDirs(ctx context.Context) ([]string, error) {
	ids, err := idMap(ctx)
	if err != nil {
		return nil, err
	}
	entries, err := os.ReadDir(s.snapshotsDir())
	if err != nil {
		return nil, err
	}
	// After the listing: every new-* name listed that a live call is
	// building was reserved before its mkdir, so before the listing.
	s.mu.Lock()
	defer s.mu.Unlock()
	var out []string
	for _, e := range entries {
		name := e.Name()
		if _, ok := ids[name]; ok {
			continue
		}
		if _, ok := s.building[name]; ok {
			continue
		}
		out = append(out, filepath.Join(s.snapshotsDir(), name))
	}
	return out, nil
}

// missingDirs lists the keys of snapshots whose directory is gone.
func (s *Snapshotter) missingDirs(ctx context.Context) ([]string, error) {
	var missing []string
	err := s.ms.WithTransaction(ctx, false, func(ctx context.Context) error {
		ids, err := idMap(ctx)
		if err != nil {
			return err
		}
		for id, key := range ids {
			if _, err := os.Stat(s.upperPath(id)); errors.Is(err, os.ErrNotExist) {
				missing = append(missing, key)
			}
		}
		return nil
	})
	return missing, err
}

// Close closes the metadata store; later calls return the first result.
func (s *Snapshotter) Close() error {
	s.closeOnce.Do(func() {
		s.closeErr = s.ms.Close()
		s.lock.Close()
	})
	return s.closeErr
}

// newDir creates the new-* directory a snapshot is built in, renamed to its
// id by the transaction that records it.
//
// No sweep may remove a directory being built (Remove's and Cleanup's
// orphanDirs): a freeze fills its directory for seconds outside any
// transaction. So its name is entered in s.building before the mkdir, and
// orphanDirs reads s.building after listing the directory: a name the
// listing holds was created, hence reserved, before the listing, and is
// skipped. It stays reserved until it is renamed to its id (inside the
// recording transaction, which no sweep overlaps) or has been removed
// (untrack). A crashed process reserved nothing in the new one, so the
// Cleanup in New removes its leftovers.
func (s *Snapshotter) newDir(kind snapshots.Kind, freeze bool) (string, error) {
	var td string
	for {
		name := "new-" + strconv.FormatUint(rand.Uint64(), 36)
		s.mu.Lock()
		_, taken := s.building[name]
		if !taken {
			s.building[name] = freeze
		}
		s.mu.Unlock()
		if taken {
			continue
		}
		td = filepath.Join(s.snapshotsDir(), name)
		err := os.Mkdir(td, 0o700)
		if err == nil {
			break
		}
		s.untrack(td)
		if !errors.Is(err, os.ErrExist) { // else a crash leftover: pick another name
			return "", fmt.Errorf("create snapshot dir: %w", err)
		}
	}
	testHookNewDir(td)
	if err := os.Mkdir(filepath.Join(td, "fs"), 0o755); err != nil {
		return td, err
	}
	if kind == snapshots.KindActive {
		if err := os.Mkdir(filepath.Join(td, "work"), 0o711); err != nil {
			return td, err
		}
	}
	return td, nil
}

// testHookNewDir is called right after a new-* directory is created.
var testHookNewDir = func(td string) {}

// untrack ends the reservation newDir made for td.
func (s *Snapshotter) untrack(td string) {
	s.mu.Lock()
	delete(s.building, filepath.Base(td))
	s.mu.Unlock()
}

func (s *Snapshotter) createSnapshot(ctx context.Context, kind snapshots.Kind, key, parent string, opts []snapshots.Opt) (_ []mount.Mount, err error) {
	var base snapshots.Info
	for _, o := range opts {
		if err := o(&base); err != nil {
			return nil, err
		}
	}
	source, freezing := base.Labels[FreezeSourceLabel]
	if freezing && kind != snapshots.KindActive {
		return nil, fmt.Errorf("label %s is only valid on Prepare: %w", FreezeSourceLabel, errdefs.ErrInvalidArgument)
	}

	var td, path string
	defer func() {
		if td != "" {
			// Removed while still reserved, so no sweep races this removal.
			if err1 := os.RemoveAll(td); err1 != nil {
				log.G(ctx).WithError(err1).WithField("path", td).Warn("failed to remove temp snapshot dir")
			}
			s.untrack(td)
		}
		if err != nil && path != "" {
			if err1 := os.RemoveAll(path); err1 != nil {
				log.G(ctx).WithError(err1).WithField("path", path).Error("failed to reclaim snapshot dir")
			}
		}
	}()

	var sourceKey, sourceID string
	if freezing {
		// The copy can take seconds: it runs outside any transaction (other
		// snapshot calls carry on), into a new-* dir no sweep removes (newDir).
		sourceKey, sourceID, err = s.resolveFreezeSource(ctx, key, source, parent)
		if err != nil {
			return nil, err
		}
		if td, err = s.newDir(kind, true); err != nil {
			return nil, err
		}
		if err = s.precopy(ctx, td, sourceID); err != nil {
			return nil, fmt.Errorf("freeze %q into %q: %w", source, key, err)
		}
	}

	var snap storage.Snapshot
	if err := s.ms.WithTransaction(ctx, true, func(ctx context.Context) (err error) {
		if freezing {
			// The source may have been removed while we copied.
			id, _, _, err := storage.GetInfo(ctx, sourceKey)
			if err != nil || id != sourceID {
				return fmt.Errorf("freeze source %q went away during the copy: %w", source, errdefs.ErrNotFound)
			}
		} else {
			if td, err = s.newDir(kind, false); err != nil {
				return err
			}
		}
		snap, err = storage.CreateSnapshot(ctx, kind, key, parent, opts...)
		if err != nil {
			return fmt.Errorf("create snapshot %q: %w", key, err)
		}
		if !freezing && len(snap.ParentIDs) > 0 {
			// An empty upper takes the owner of the parent's root, so a
			// non-root image keeps its root directory owner.
			st, err := os.Stat(s.upperPath(snap.ParentIDs[0]))
			if err != nil {
				return fmt.Errorf("stat parent layer: %w", err)
			}
			if sys, ok := st.Sys().(*syscall.Stat_t); ok {
				if err := os.Lchown(filepath.Join(td, "fs"), int(sys.Uid), int(sys.Gid)); err != nil {
					return err
				}
			}
		}
		path = filepath.Join(s.snapshotsDir(), snap.ID)
		if err := os.Rename(td, path); err != nil {
			return fmt.Errorf("rename snapshot dir: %w", err)
		}
		s.untrack(td)
		td = ""
		return nil
	}); err != nil {
		return nil, err
	}
	return s.mounts(snap), nil
}

func (s *Snapshotter) mounts(snap storage.Snapshot) []mount.Mount {
	if len(snap.ParentIDs) == 0 {
		// A single layer cannot be an overlay: bind it.
		ro := "rw"
		if snap.Kind == snapshots.KindView {
			ro = "ro"
		}
		return []mount.Mount{{Type: "bind", Source: s.upperPath(snap.ID), Options: []string{ro, "rbind"}}}
	}
	var options []string
	if snap.Kind == snapshots.KindActive {
		options = append(options,
			"workdir="+s.workPath(snap.ID),
			"upperdir="+s.upperPath(snap.ID))
	} else if len(snap.ParentIDs) == 1 {
		return []mount.Mount{{Type: "bind", Source: s.upperPath(snap.ParentIDs[0]), Options: []string{"ro", "rbind"}}}
	}
	lowers := make([]string, len(snap.ParentIDs))
	for i, id := range snap.ParentIDs {
		lowers[i] = s.upperPath(id)
	}
	options = append(options, "lowerdir="+strings.Join(lowers, ":"))
	options = append(options, s.options...)
	return []mount.Mount{{Type: "overlay", Source: "overlay", Options: options}}
}

// idMap is storage.IDMap, empty (not an error) before the first snapshot.
func idMap(ctx context.Context) (map[string]string, error) {
	ids, err := storage.IDMap(ctx)
	if errdefs.IsNotFound(err) {
		return map[string]string{}, nil
	}
	return ids, err
}

// walkInfo is storage.WalkInfo, calling nothing (not failing) before the
// first snapshot exists.
func walkInfo(ctx context.Context, fn snapshots.WalkFunc, filters ...string) error {
	called := false
	err := storage.WalkInfo(ctx, func(ctx context.Context, info snapshots.Info) error {
		called = true
		return fn(ctx, info)
	}, filters...)
	if !called && errdefs.IsNotFound(err) {
		return nil
	}
	return err
}
