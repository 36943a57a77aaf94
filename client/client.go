package client

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"time"

	containerd "github.com/containerd/containerd/v2/client"
	"github.com/containerd/errdefs"
	"github.com/containerd/log"

	"github.com/lazyfork/lazyfork/api"
	"github.com/lazyfork/lazyfork/node"
	snapclient "github.com/lazyfork/lazyfork/snapshotter/client"
)

// LabelNerdctlName is nerdctl's name of a container: names resolve by it too.
const LabelNerdctlName = "nerdctl/name"

// Client forks containers through a containerd client.
type Client struct {
	cd   *containerd.Client
	root string
	// node is what the client needs of LazyFork's root: its files
	// (WithRoot) or the node API (the default, WithAPI).
	node        node.Node
	hookTimeout time.Duration
	owned       bool // Connect made cd; Close closes it
	// maxForks bounds n of one Fork call (WithMaxForks, LAZYFORK_MAX_FORKS).
	maxForks int
	// restoreTimeout bounds each fork's task create + start.
	restoreTimeout time.Duration
	// groupSize is how many forks of a family share a shim process.
	groupSize int
	// noShimJoin starts every fork's shim through the shim binary
	// (WithShimJoin(false)).
	noShimJoin bool
}

// Opt configures a Client.
type Opt func(*Client)

// WithRoot works on the files of LazyFork's root dir (the shim's
// LAZYFORK_ROOT: memory files in ROOT/mem, snapshots in ROOT/snapshots)
// directly, in this process: for users on the node itself (the shim, tests).
// Without it, the client asks lazyfork-snapshotter's node API (WithAPI).
func WithRoot(dir string) Opt {
	return func(c *Client) { c.root, c.node = dir, node.NewLocal(dir) }
}

// WithAPI has the client ask the node API at socket (lazyfork-snapshotter's
// ttrpc socket) for everything of LazyFork's root: the default, at
// $LAZYFORK_API or api.DefaultAPISocket. With it and containerd's socket a
// client needs nothing else of the node.
func WithAPI(socket string) Opt {
	return func(c *Client) { c.root, c.node = "", node.NewRemote(socket) }
}

// WithNode sets what the client asks of LazyFork's root.
func WithNode(n node.Node) Opt { return func(c *Client) { c.node = n } }

// WithHookTimeout bounds the wait for a container's hook to answer
// (default hook.DefaultTimeout).
func WithHookTimeout(d time.Duration) Opt { return func(c *Client) { c.hookTimeout = d } }

// WithMaxForks bounds the forks one Fork call may make (default
// DefaultMaxForks, or LAZYFORK_MAX_FORKS).
func WithMaxForks(n int) Opt { return func(c *Client) { c.maxForks = n } }

// WithRestoreTimeout bounds each fork's restore, its task create and start
// (default DefaultRestoreTimeout); a fork past it is removed.
func WithRestoreTimeout(d time.Duration) Opt { return func(c *Client) { c.restoreTimeout = d } }

// WithShimGroupSize sets how many forks of a family share a shim process
// (default DefaultShimGroupSize): a shim that dies takes only its group. A
// call's forks fill a shim an earlier call's forks of the family run in when
// it has room for them (1: every fork a shim of its own).
func WithShimGroupSize(n int) Opt { return func(c *Client) { c.groupSize = n } }

// WithShimJoin(false) has containerd run the shim binary for every fork's
// task, as for any container, instead of joining a shim group's forks to the
// shim its first fork started (shimjoin.go; the default, where containerd
// has a sandbox store).
func WithShimJoin(on bool) Opt { return func(c *Client) { c.noShimJoin = !on } }

// DefaultRestoreTimeout bounds a fork's restore unless WithRestoreTimeout.
const DefaultRestoreTimeout = 2 * time.Minute

// DefaultShimGroupSize is how many forks of a family share a shim process:
// a shim holds 7-10 MB (PSS) of its own, and one that dies takes its group
// (never the parent, which has a shim of its own). 100 forks run on two,
// whether made at once or one a call.
const DefaultShimGroupSize = 50

// New returns a LazyFork client on top of a containerd client; the caller keeps
// ownership of cd (and its namespace in the contexts it passes).
func New(cd *containerd.Client, opts ...Opt) *Client {
	c := &Client{cd: cd, maxForks: maxForksFromEnv(),
		restoreTimeout: DefaultRestoreTimeout, groupSize: DefaultShimGroupSize}
	for _, o := range opts {
		o(c)
	}
	if c.node == nil {
		c.node = node.NewRemote(DefaultAPISocket())
	}
	if c.groupSize < 1 {
		c.groupSize = DefaultShimGroupSize
	}
	return c
}

// Containerd returns the underlying containerd client.
func (c *Client) Containerd() *containerd.Client { return c.cd }

// Root is LazyFork's root directory when the client works on its files
// (WithRoot), "" when it asks the node API.
func (c *Client) Root() string { return c.root }

// Node is what the client asks of LazyFork's root.
func (c *Client) Node() node.Node { return c.node }

// DefaultAPISocket is the node API's socket: $LAZYFORK_API, else the one of
// $LAZYFORK_ROOT, else api.DefaultAPISocket.
func DefaultAPISocket() string {
	if v := os.Getenv("LAZYFORK_API"); v != "" {
		return v
	}
	if v := os.Getenv("LAZYFORK_ROOT"); v != "" {
		return api.Root(v).APISocket()
	}
	return api.DefaultAPISocket
}

// RemoveSnapshot deletes a LazyFork snapshot made by Fork with KeepSnapshot (its
// image directory, as in Result.Snapshot) and drops its reference on the
// family's memory files. Files still mapped by a fork stay.
func (c *Client) RemoveSnapshot(ctx context.Context, imageDir string) error {
	imageDir = filepath.Clean(imageDir)
	if filepath.Base(imageDir) != api.ImageDirName {
		return fmt.Errorf("%s is not a snapshot made by Fork (no %s directory): %w", imageDir, api.ImageDirName, errdefs.ErrInvalidArgument)
	}
	snap, err := c.node.Snapshot(ctx, imageDir)
	if err != nil && !errdefs.IsNotFound(err) {
		return fmt.Errorf("read snapshot %s: %w", imageDir, err)
	}
	if snap != nil && snap.Rootfs != nil && snap.Rootfs.Frozen != "" {
		c.releaseFrozen(ctx, snap.Rootfs.Frozen)
	}
	return c.node.RemoveSnapshot(ctx, filepath.Dir(imageDir))
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
