//go:build linux

package snapshotter

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"sync"
	"sync/atomic"
	"time"

	"github.com/containerd/containerd/v2/core/mount"
	"github.com/containerd/containerd/v2/core/snapshots"
	"github.com/containerd/containerd/v2/core/snapshots/storage"
	"github.com/containerd/containerd/v2/plugins/snapshots/overlay"
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

// overlaySnapshotter names the embedded snapshotter without exporting it.
type overlaySnapshotter = snapshots.Snapshotter

// Snapshotter is containerd's overlay snapshotter
// (plugins/snapshots/overlay) with frozen layers. Every call but the freeze's
// Prepare and Commit goes to the overlay snapshotter unchanged; the two share
// one metadata store (overlay.WithMetaStore), which is how a freeze reads the
// records and checks its preconditions inside the overlay's transactions.
type Snapshotter struct {
	overlaySnapshotter

	root string
	ms   *storage.MetaStore

	// building counts the freezes copying a source right now (Status).
	building atomic.Int64
	// freezes is read-held by each freeze's Prepare and Commit, so that
	// Close waits for them (cancelled, they return fast) to clean up.
	freezes sync.RWMutex

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
	oopts := []overlay.Opt{overlay.WithMetaStore(checkedStore{ms}), overlay.WithMountOptions(c.mountOptions)}
	if c.asyncRemove {
		oopts = append(oopts, overlay.AsynchronousRemove)
	}
	o, err := overlay.NewSnapshotter(root, oopts...)
	if err != nil {
		ms.Close()
		lock.Close()
		return nil, fmt.Errorf("overlay snapshotter on %s: %w", root, err)
	}
	s := &Snapshotter{overlaySnapshotter: o, root: root, ms: ms, lock: lock}
	if err := s.initStore(ctx); err != nil {
		s.Close()
		return nil, fmt.Errorf("initialize metadata of %s: %w", root, err)
	}
	if err := s.Cleanup(ctx); err != nil {
		s.Close()
		return nil, fmt.Errorf("reconcile %s on start: %w", root, err)
	}
	s.removeStaleFreezeDirs(ctx)
	missing, err := s.missingDirs(ctx)
	if err != nil {
		s.Close()
		return nil, err
	}
	for _, m := range missing {
		log.G(ctx).WithField("key", m).Error("snapshot has no directory on disk; remove it")
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

// initKey is a snapshot that exists only inside initStore's transaction.
const initKey = "lazyfork-init"

// initStore makes sure the metadata has its buckets. The storage package
// creates them with the first snapshot, and until then its IDMap and
// WalkInfo fail with NotFound, hence the overlay's Walk and Cleanup (and
// Remove's sweep) too; creating and removing a snapshot in one transaction
// leaves the buckets, and nothing else.
func (s *Snapshotter) initStore(ctx context.Context) error {
	return s.ms.WithTransaction(ctx, true, func(ctx context.Context) error {
		if _, err := storage.IDMap(ctx); !errdefs.IsNotFound(err) {
			return err
		}
		if _, err := storage.CreateSnapshot(ctx, snapshots.KindActive, initKey, ""); err != nil {
			return err
		}
		_, _, err := storage.Remove(ctx, initKey)
		return err
	})
}

// Root is the directory the snapshotter keeps everything in.
func (s *Snapshotter) Root() string { return s.root }

// The overlay snapshotter's layout under root (overlay.go, upperPath).
func (s *Snapshotter) snapshotsDir() string { return filepath.Join(s.root, "snapshots") }
func (s *Snapshotter) snapshotDir(id string) string {
	return filepath.Join(s.root, "snapshots", id)
}
func (s *Snapshotter) upperPath(id string) string { return filepath.Join(s.snapshotDir(id), "fs") }

// Prepare creates an active snapshot on parent. With the label
// FreezeSourceLabel, its layer starts as a copy of that active snapshot's
// upper dir (see package doc).
func (s *Snapshotter) Prepare(ctx context.Context, key, parent string, opts ...snapshots.Opt) ([]mount.Mount, error) {
	source, freezing, err := freezeSource(opts)
	if err != nil {
		return nil, err
	}
	if freezing {
		return s.prepareFreeze(ctx, key, parent, source, opts)
	}
	return s.overlaySnapshotter.Prepare(ctx, key, parent, opts...)
}

// View creates a read-only snapshot of parent.
func (s *Snapshotter) View(ctx context.Context, key, parent string, opts ...snapshots.Opt) ([]mount.Mount, error) {
	if _, freezing, err := freezeSource(opts); err != nil {
		return nil, err
	} else if freezing {
		return nil, fmt.Errorf("label %s is only valid on Prepare: %w", FreezeSourceLabel, errdefs.ErrInvalidArgument)
	}
	return s.overlaySnapshotter.View(ctx, key, parent, opts...)
}

// Commit turns the active snapshot key into the committed snapshot name; a
// freeze's snapshot first catches up with its source (see freeze.go).
func (s *Snapshotter) Commit(ctx context.Context, name, key string, opts ...snapshots.Opt) error {
	id, info, err := s.info(ctx, key)
	if err != nil {
		return err
	}
	source, ok := info.Labels[FreezeSourceLabel]
	if !ok || info.Kind != snapshots.KindActive {
		return s.overlaySnapshotter.Commit(ctx, name, key, opts...)
	}
	s.freezes.RLock()
	defer s.freezes.RUnlock()
	// Outside any transaction: other calls carry on meanwhile.
	if err := s.syncFreeze(ctx, key, id, source, info.Parent); err != nil {
		return fmt.Errorf("commit freeze %q: %w", key, err)
	}
	return s.overlaySnapshotter.Commit(withTxCheck(ctx, func(ctx context.Context) error {
		now, _, _, err := storage.GetInfo(ctx, key)
		if err != nil {
			return err
		}
		if now != id {
			return fmt.Errorf("commit %q: snapshot replaced during the freeze: %w", key, errdefs.ErrFailedPrecondition)
		}
		return nil
	}), name, key, opts...)
}

// Cleanup removes every directory under root/snapshots that the metadata
// does not know (removed snapshots, crash leftovers).
func (s *Snapshotter) Cleanup(ctx context.Context) error {
	return s.overlaySnapshotter.(snapshots.Cleaner).Cleanup(ctx)
}

// info reads key's id and info.
func (s *Snapshotter) info(ctx context.Context, key string) (id string, info snapshots.Info, err error) {
	err = s.ms.WithTransaction(ctx, false, func(ctx context.Context) (err error) {
		id, info, _, err = storage.GetInfo(ctx, key)
		return err
	})
	return id, info, err
}

// missingDirs lists the keys of snapshots whose directory is gone.
func (s *Snapshotter) missingDirs(ctx context.Context) ([]string, error) {
	var missing []string
	err := s.ms.WithTransaction(ctx, false, func(ctx context.Context) error {
		ids, err := storage.IDMap(ctx)
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

// Close waits for the freezes in flight to return (cancel their contexts
// first), then closes the metadata store; later calls return the first
// result.
func (s *Snapshotter) Close() error {
	s.closeOnce.Do(func() {
		s.freezes.Lock()
		defer s.freezes.Unlock()
		s.closeErr = s.overlaySnapshotter.Close()
		s.lock.Close()
	})
	return s.closeErr
}

// checkedStore is the metadata store the overlay snapshotter runs on: a
// write transaction whose context carries a check (withTxCheck) runs it
// first, so that a freeze's precondition holds atomically with what the
// overlay records.
type checkedStore struct{ *storage.MetaStore }

type txCheckKey struct{}

// withTxCheck makes check run at the start of every write transaction the
// overlay snapshotter opens on ctx.
func withTxCheck(ctx context.Context, check func(context.Context) error) context.Context {
	return context.WithValue(ctx, txCheckKey{}, check)
}

func (m checkedStore) WithTransaction(ctx context.Context, writable bool, fn storage.TransactionCallback) error {
	check, ok := ctx.Value(txCheckKey{}).(func(context.Context) error)
	if !writable || !ok {
		return m.MetaStore.WithTransaction(ctx, writable, fn)
	}
	return m.MetaStore.WithTransaction(ctx, true, func(ctx context.Context) error {
		if err := check(ctx); err != nil {
			return err
		}
		return fn(ctx)
	})
}
