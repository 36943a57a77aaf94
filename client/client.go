package client

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"time"

	containerd "github.com/containerd/containerd/v2/client"
	"github.com/containerd/errdefs"
	"github.com/containerd/log"

	"github.com/lazyfork/lazyfork/api"
	"github.com/lazyfork/lazyfork/memfile"
	snapclient "github.com/lazyfork/lazyfork/snapshotter/client"
)

// LabelNerdctlName is nerdctl's name of a container: names resolve by it too.
const LabelNerdctlName = "nerdctl/name"

// Client forks containers through a containerd client.
type Client struct {
	cd          *containerd.Client
	root        string
	hookTimeout time.Duration
	owned       bool // Connect made cd; Close closes it
	// maxForks bounds n of one Fork call (WithMaxForks, LAZYFORK_MAX_FORKS).
	maxForks int
	// restoreTimeout bounds each fork's task create + start.
	restoreTimeout time.Duration
	// groupSize is how many forks of one call share a shim process.
	groupSize int
}

// Opt configures a Client.
type Opt func(*Client)

// WithRoot sets LazyFork's root (the shim's LAZYFORK_ROOT): memory files live in
// ROOT/mem, snapshots in ROOT/snapshots.
func WithRoot(dir string) Opt { return func(c *Client) { c.root = dir } }

// WithHookTimeout bounds the wait for a container's hook to answer
// (default hook.DefaultTimeout).
func WithHookTimeout(d time.Duration) Opt { return func(c *Client) { c.hookTimeout = d } }

// WithMaxForks bounds the forks one Fork call may make (default
// DefaultMaxForks, or LAZYFORK_MAX_FORKS).
func WithMaxForks(n int) Opt { return func(c *Client) { c.maxForks = n } }

// WithRestoreTimeout bounds each fork's restore, its task create and start
// (default DefaultRestoreTimeout); a fork past it is removed.
func WithRestoreTimeout(d time.Duration) Opt { return func(c *Client) { c.restoreTimeout = d } }

// WithShimGroupSize sets how many forks of one call share a shim process
// (default DefaultShimGroupSize): a shim that dies takes only its group.
func WithShimGroupSize(n int) Opt { return func(c *Client) { c.groupSize = n } }

// DefaultRestoreTimeout bounds a fork's restore unless WithRestoreTimeout.
const DefaultRestoreTimeout = 2 * time.Minute

// DefaultShimGroupSize is how many forks of one call share a shim process:
// a shim holds 7-10 MB (PSS) of its own, and one that dies takes its group
// (never the parent, which has a shim of its own). 100 forks run on two.
const DefaultShimGroupSize = 50

// New returns a LazyFork client on top of a containerd client; the caller keeps
// ownership of cd (and its namespace in the contexts it passes).
func New(cd *containerd.Client, opts ...Opt) *Client {
	c := &Client{cd: cd, root: api.DefaultRoot, maxForks: maxForksFromEnv(),
		restoreTimeout: DefaultRestoreTimeout, groupSize: DefaultShimGroupSize}
	if v := os.Getenv("LAZYFORK_ROOT"); v != "" {
		c.root = v
	}
	for _, o := range opts {
		o(c)
	}
	if c.groupSize < 1 {
		c.groupSize = DefaultShimGroupSize
	}
	return c
}

// Containerd returns the underlying containerd client.
func (c *Client) Containerd() *containerd.Client { return c.cd }

// Root is LazyFork's root directory.
func (c *Client) Root() string { return c.root }

func (c *Client) snapshotsDir() string { return api.Root(c.root).Snapshots() }

// RemoveSnapshot deletes a LazyFork snapshot made by Fork with KeepSnapshot (its
// image directory, as in Result.Snapshot) and drops its reference on the
// family's memory files. Files still mapped by a fork stay.
func (c *Client) RemoveSnapshot(ctx context.Context, imageDir string) error {
	imageDir = filepath.Clean(imageDir)
	snapDir := filepath.Dir(imageDir)
	if filepath.Dir(snapDir) != c.snapshotsDir() || filepath.Base(imageDir) != api.ImageDirName {
		return fmt.Errorf("%s is not a snapshot made by Fork under %s: %w", imageDir, c.snapshotsDir(), errdefs.ErrInvalidArgument)
	}
	var family string
	if info, err := memfile.ReadSnapshot(imageDir); err == nil {
		family = info.Family
	} else if !errdefs.IsNotFound(err) && !errors.Is(err, os.ErrNotExist) {
		return fmt.Errorf("read snapshot %s: %w", imageDir, err)
	}
	if rfs, err := readRootfsSource(snapDir); err == nil && rfs.Frozen != "" {
		c.releaseFrozen(ctx, rfs.Frozen)
	}
	return c.removeSnapshot(family, snapDir)
}

// releaseFrozen drops a kept snapshot's frozen layer: removed at once if no
// fork stacks on it, else left to containerd's garbage collector once the
// last fork goes.
func (c *Client) releaseFrozen(ctx context.Context, name string) {
	sn := c.cd.SnapshotService(snapclient.SnapshotterName)
	if err := sn.Remove(ctx, name); err == nil || errdefs.IsNotFound(err) {
		return
	}
	info, err := sn.Stat(ctx, name)
	if err != nil {
		return
	}
	delete(info.Labels, gcRootLabel)
	if _, err := sn.Update(ctx, info, "labels."+gcRootLabel); err != nil {
		log.G(ctx).WithError(err).WithField("frozen", name).Warn("lazyfork: release frozen layer")
	}
}

// removeSnapshot drops the snapshot's memory-file reference (if it got one) and
// removes its directory.
func (c *Client) removeSnapshot(family, snapDir string) error {
	var errs []error
	if family != "" {
		store, err := memfile.OpenStore(api.Root(c.root).Mem())
		if err != nil {
			errs = append(errs, err)
		} else if err := store.Unref(family, snapshotHolder(api.ImageDir(snapDir))); err != nil && !errdefs.IsNotFound(err) {
			errs = append(errs, fmt.Errorf("unref snapshot: %w", err))
		}
	}
	if err := os.RemoveAll(snapDir); err != nil {
		errs = append(errs, err)
	}
	return errors.Join(errs...)
}

// snapshotHolder is the reference memfile's Rewrite gives a snapshot by default.
func snapshotHolder(imageDir string) string { return memfile.HolderSnapshot + imageDir }

func randomHex(n int) string {
	b := make([]byte, n)
	if _, err := rand.Read(b); err != nil {
		panic(err)
	}
	return hex.EncodeToString(b)
}

// forkID names a fork after its family, not its parent, so ids stay short
// however deep the fork tree grows (containerd allows 76 characters).
func forkID(family string) string {
	base := family
	if len(base) > 60 {
		base = base[:60]
	}
	return strings.TrimRight(base, "-_.") + "-" + randomHex(4)
}
