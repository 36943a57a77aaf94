package client

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"time"

	tasksapi "github.com/containerd/containerd/api/services/tasks/v1"
	runcopts "github.com/containerd/containerd/api/types/runc/options"
	containerd "github.com/containerd/containerd/v2/client"
	"github.com/containerd/containerd/v2/core/containers"
	"github.com/containerd/containerd/v2/core/snapshots"
	"github.com/containerd/containerd/v2/pkg/cio"
	"github.com/containerd/containerd/v2/pkg/namespaces"
	"github.com/containerd/containerd/v2/pkg/oci"
	"github.com/containerd/errdefs"
	"github.com/containerd/errdefs/pkg/errgrpc"
	"github.com/containerd/log"
	"github.com/containerd/typeurl/v2"

	"github.com/lazyfork/lazyfork/hook"
	"github.com/lazyfork/lazyfork/memfile"
	snapclient "github.com/lazyfork/lazyfork/snapshotter/client"
)

// ForkOpt configures one Fork call.
type ForkOpt func(*forkConfig)

type forkConfig struct {
	ids          []string
	io           func(id string) cio.Creator
	keepSnapshot bool
	labels       map[string]string
	// stayPaused leaves a parent this call paused frozen after a successful
	// snapshot (Stop ends it without letting it run past the snapshot).
	stayPaused bool
}

// WithIDs names the forks (len(ids) must be n); by default a fork is named
// <family>-<random>.
func WithIDs(ids ...string) ForkOpt { return func(c *forkConfig) { c.ids = ids } }

// WithIO gives each fork's task its stdio; by default output is discarded (see discardIO).
func WithIO(f func(id string) cio.Creator) ForkOpt { return func(c *forkConfig) { c.io = f } }

// KeepSnapshot keeps the snapshot directory after the forks run (Result.Snapshot),
// e.g. to restore more forks from it later; RemoveSnapshot deletes it.
func KeepSnapshot() ForkOpt { return func(c *forkConfig) { c.keepSnapshot = true } }

func stayPaused() ForkOpt { return func(c *forkConfig) { c.stayPaused = true } }

// WithLabels adds labels to every fork container.
func WithLabels(l map[string]string) ForkOpt { return func(c *forkConfig) { c.labels = l } }

// Fork is one fork made by Client.Fork: a container and its running task.
type Fork struct {
	Container containerd.Container
	Task      containerd.Task
	// Restore is this fork's task create → running time.
	Restore time.Duration
}

// Result describes a Fork call.
type Result struct {
	Parent   string
	Family   string
	Snapshot string // image directory of the snapshot; gone unless KeepSnapshot
	Forks    []Fork
	// Paused is how long the parent was frozen (what its users felt).
	Paused time.Duration
	// ThawedBeforeRewrite: the shim thawed the parent as soon as its dump
	// was done, so Paused leaves out the memory-file rewrite. False when
	// the caller had paused the parent (it stays paused).
	ThawedBeforeRewrite bool
	// Checkpoint is the shim's dump + memory-file rewrite.
	Checkpoint time.Duration
	// CopyUpper is the copy of the parent's writable layer.
	CopyUpper time.Duration
	// Restore is the wall time from the first fork's creation to the last one running.
	Restore time.Duration
}

// IDs returns the forks' container ids.
func (r *Result) IDs() []string {
	ids := make([]string, len(r.Forks))
	for i, f := range r.Forks {
		ids[i] = f.Container.ID()
	}
	return ids
}

// Fork makes n running copies of container parentID (whose task must run under
// io.containerd.lazyfork.v1). On error the parent keeps running, unpaused, and
// nothing Fork made is left.
func (c *Client) Fork(ctx context.Context, parentID string, n int, opts ...ForkOpt) (*Result, error) {
	if n < 1 {
		return nil, fmt.Errorf("fork %s: n = %d: %w", parentID, n, errdefs.ErrInvalidArgument)
	}
	return c.fork(ctx, parentID, n, opts...)
}

// fork is Fork; n = 0 takes the snapshot only (Checkpoint).
func (c *Client) fork(ctx context.Context, parentID string, n int, opts ...ForkOpt) (_ *Result, retErr error) {
	var cfg forkConfig
	for _, o := range opts {
		o(&cfg)
	}
	if cfg.ids != nil && len(cfg.ids) != n {
		return nil, fmt.Errorf("fork %s: %d ids for %d forks: %w", parentID, len(cfg.ids), n, errdefs.ErrInvalidArgument)
	}
	if cfg.io == nil {
		cfg.io = discardIO
	}
	// The lease keeps the forks' fresh snapshots from containerd's GC until
	// their containers reference them.
	ctx, done, err := c.cd.WithLease(ctx)
	if err != nil {
		return nil, fmt.Errorf("fork %s: lease: %w", parentID, err)
	}
	defer done(context.WithoutCancel(ctx))

	parent, err := c.cd.LoadContainer(ctx, parentID)
	if err != nil {
		return nil, fmt.Errorf("fork %s: %w", parentID, err)
	}
	info, err := parent.Info(ctx)
	if err != nil {
		return nil, fmt.Errorf("fork %s: %w", parentID, err)
	}
	if info.Runtime.Name != RuntimeName {
		return nil, fmt.Errorf("fork %s: runs under %s, not %s (the memory mount must be there from creation): %w",
			parentID, info.Runtime.Name, RuntimeName, errdefs.ErrFailedPrecondition)
	}
	spec, err := parent.Spec(ctx)
	if err != nil {
		return nil, fmt.Errorf("fork %s: spec: %w", parentID, err)
	}
	task, err := parent.Task(ctx, nil)
	var st containerd.Status
	if err == nil {
		st, err = task.Status(ctx)
	}
	if err != nil || st.Status != containerd.Running && st.Status != containerd.Paused {
		// A stopped container forks from the snapshot Stop kept.
		if snap := info.Labels[LabelStopped]; snap != "" && n > 0 {
			forks, err := c.RestoreForks(ctx, parentID, snap, n, opts...)
			if err != nil {
				return nil, err
			}
			var took time.Duration
			for _, f := range forks {
				took = max(took, f.Restore)
			}
			return &Result{Parent: parentID, Family: info.Labels[LabelFamily], Snapshot: snap, Forks: forks, Restore: took}, nil
		}
		if err != nil && !errdefs.IsNotFound(err) {
			return nil, fmt.Errorf("fork %s: task: %w", parentID, err)
		}
		state := "no task"
		if err == nil {
			state = "task " + string(st.Status)
		}
		return nil, fmt.Errorf("fork %s: cannot be forked: %s and no snapshot (it was not stopped with lazyfork stop): %w",
			parentID, state, errdefs.ErrFailedPrecondition)
	}

	if err := os.MkdirAll(c.snapshotsDir(), 0o700); err != nil {
		return nil, fmt.Errorf("fork %s: %w", parentID, err)
	}
	snapDir, err := os.MkdirTemp(c.snapshotsDir(), "")
	if err != nil {
		return nil, fmt.Errorf("fork %s: %w", parentID, err)
	}
	imageDir := filepath.Join(snapDir, "image")
	rfs := &rootfsSource{}
	res := &Result{Parent: parentID, Snapshot: imageDir}
	defer func() {
		if retErr != nil && rfs.Frozen != "" {
			// No fork is left to stack on the frozen layer: drop it.
			if err := c.cd.SnapshotService(info.Snapshotter).Remove(context.WithoutCancel(ctx), rfs.Frozen); err != nil && !errdefs.IsNotFound(err) {
				log.G(ctx).WithError(err).WithField("frozen", rfs.Frozen).Warn("lazyfork: remove frozen layer")
			}
		}
		if retErr != nil || !cfg.keepSnapshot {
			if err := c.removeSnapshot(res.Family, snapDir); err != nil {
				log.G(ctx).WithError(err).WithField("snapshot", snapDir).Warn("lazyfork: remove snapshot")
			}
			if retErr != nil {
				res.Snapshot = ""
			}
		}
	}()
	if err := os.Mkdir(imageDir, 0o700); err != nil {
		return nil, fmt.Errorf("fork %s: %w", parentID, err)
	}

	if err := c.snapshot(ctx, parent, info, task, st.Status == containerd.Paused, imageDir, rfs, &cfg, res); err != nil {
		return nil, fmt.Errorf("fork %s: %w", parentID, err)
	}
	rfs.Snapshotter = info.Snapshotter
	rfs.Namespace, _ = namespaces.Namespace(ctx)
	if err := writeRootfsSource(snapDir, rfs); err != nil {
		return nil, fmt.Errorf("fork %s: %w", parentID, err)
	}

	if n == 0 {
		return res, nil
	}
	forks, restore, err := c.restoreForks(ctx, parentID, info, spec, res.Family, imageDir, rfs, n, &cfg)
	if err != nil {
		return nil, fmt.Errorf("fork %s: %w", parentID, err)
	}
	res.Forks, res.Restore = forks, restore
	return res, nil
}

// RestoreForks restores n more forks of parentID from a snapshot kept by Fork
// (KeepSnapshot; imageDir is its Result.Snapshot). The parent container must
// still exist (its spec, image and runtime are cloned); its task need not run.
// On error nothing is left of the forks.
func (c *Client) RestoreForks(ctx context.Context, parentID, imageDir string, n int, opts ...ForkOpt) (_ []Fork, retErr error) {
	var cfg forkConfig
	for _, o := range opts {
		o(&cfg)
	}
	if n < 1 || cfg.ids != nil && len(cfg.ids) != n {
		return nil, fmt.Errorf("restore forks of %s: n = %d, %d ids: %w", parentID, n, len(cfg.ids), errdefs.ErrInvalidArgument)
	}
	if cfg.io == nil {
		cfg.io = discardIO
	}
	ctx, done, err := c.cd.WithLease(ctx)
	if err != nil {
		return nil, err
	}
	defer done(context.WithoutCancel(ctx))
	snap, err := memfile.ReadSnapshot(imageDir)
	if err != nil {
		return nil, fmt.Errorf("restore forks of %s: snapshot %s: %w", parentID, imageDir, err)
	}
	rfs, err := readRootfsSource(filepath.Dir(imageDir))
	if err != nil {
		return nil, fmt.Errorf("restore forks of %s: snapshot %s (not made by Fork?): %w", parentID, imageDir, err)
	}
	parent, err := c.cd.LoadContainer(ctx, parentID)
	if err != nil {
		return nil, fmt.Errorf("restore forks of %s: %w", parentID, err)
	}
	info, err := parent.Info(ctx)
	if err != nil {
		return nil, err
	}
	spec, err := parent.Spec(ctx)
	if err != nil {
		return nil, err
	}
	forks, _, err := c.restoreForks(ctx, parentID, info, spec, snap.Family, imageDir, rfs, n, &cfg)
	if err != nil {
		return nil, fmt.Errorf("restore forks of %s: %w", parentID, err)
	}
	return forks, nil
}

// restoreForks makes n forks at once; if any fails, all are removed.
func (c *Client) restoreForks(ctx context.Context, parentID string, info containers.Container, spec *oci.Spec,
	family, imageDir string, rfs *rootfsSource, n int, cfg *forkConfig) ([]Fork, time.Duration, error) {
	ids := cfg.ids
	if ids == nil {
		ids = make([]string, n)
		for i := range ids {
			ids[i] = forkID(family)
		}
	}
	forks := make([]Fork, n)
	errs := make([]error, n)
	start := time.Now()
	var wg sync.WaitGroup
	for i := range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			forks[i], errs[i] = c.restoreFork(ctx, ids[i], parentID, info, spec, family, imageDir, rfs, cfg)
		}()
	}
	wg.Wait()
	took := time.Since(start)
	if err := errors.Join(errs...); err != nil {
		for _, f := range forks {
			if f.Container != nil {
				removeFork(context.WithoutCancel(ctx), f)
			}
		}
		return nil, took, err
	}
	return forks, took, nil
}

// snapshot freezes the parent, checkpoints it through the shim, captures its
// writable layer (a frozen layer on LazyFork's snapshotter, else a copy aside),
// and thaws it again (whatever happened, unless the caller had it paused
// already).
func (c *Client) snapshot(ctx context.Context, parent containerd.Container, info containers.Container, task containerd.Task,
	wasPaused bool, imageDir string, rfs *rootfsSource, cfg *forkConfig, res *Result) (retErr error) {
	var pending *snapclient.PendingFreeze
	if info.Snapshotter == snapclient.SnapshotterName {
		// The bulk of the layer copy happens before the pause; Commit only
		// catches up with what changed meanwhile.
		var labels map[string]string
		if cfg.keepSnapshot {
			labels = map[string]string{gcRootLabel: time.Now().UTC().Format(time.RFC3339)}
		}
		name := "lazyfork-frozen-" + filepath.Base(filepath.Dir(imageDir))
		p, err := snapclient.StartFreeze(ctx, c.cd.SnapshotService(info.Snapshotter), info.SnapshotKey, name, snapshots.WithLabels(labels))
		if err != nil {
			return fmt.Errorf("start freezing the writable layer: %w", err)
		}
		pending = p
		defer func() {
			if pending != nil {
				if err := pending.Abort(ctx); err != nil {
					log.G(ctx).WithError(err).Warn("lazyfork: abort freeze")
				}
			}
		}()
	}
	if dir := info.Labels[hook.Label]; dir != "" && !wasPaused {
		if err := hook.Quiesce(ctx, hook.HostSocket(dir, parent.ID()), c.hookTimeout); err != nil {
			return fmt.Errorf("quiesce: %w", err)
		}
	}
	t0 := time.Now()
	thawedEarly := false
	if !wasPaused {
		if err := task.Pause(ctx); err != nil {
			return fmt.Errorf("pause: %w", err)
		}
		defer func() {
			if cfg.stayPaused && retErr == nil {
				res.Paused = time.Since(t0)
				return
			}
			if err := task.Resume(context.WithoutCancel(ctx)); err != nil {
				retErr = errors.Join(retErr, fmt.Errorf("resume parent: %w", err))
			}
			if !thawedEarly {
				res.Paused = time.Since(t0)
			}
		}()
	}
	// The writable layer first: frozen, the task cannot change it between
	// this copy and its dump.
	t2 := time.Now()
	if pending != nil {
		frozen, err := pending.Commit(ctx)
		pending = nil // Commit aborts by itself on error
		if err != nil {
			return fmt.Errorf("freeze writable layer of %s: %w", parent.ID(), err)
		}
		rfs.Frozen = frozen.Name
	} else {
		upper, err := c.upperDir(ctx, info.Snapshotter, info.SnapshotKey)
		if err != nil {
			return err
		}
		rfs.UpperCopy = filepath.Join(filepath.Dir(imageDir), "upper")
		if err := copyLayer(rfs.UpperCopy, upper); err != nil {
			return fmt.Errorf("copy writable layer of %s: %w", parent.ID(), err)
		}
	}
	res.CopyUpper = time.Since(t2)

	// A task paused here is thawed by the shim once its dump is done, while
	// the memory files are written (memfile.ThawFile); a task the caller had
	// paused stays paused.
	thaw := memfile.ThawFile(imageDir)
	if !wasPaused && !cfg.stayPaused {
		if err := os.WriteFile(thaw, nil, 0o600); err != nil {
			return err
		}
		defer os.Remove(thaw)
	}
	opts, err := typeurl.MarshalAnyToProto(&runcopts.CheckpointOptions{ImagePath: imageDir})
	if err != nil {
		return err
	}
	t1 := time.Now()
	// The task API directly, not Task.Checkpoint: for a runtime that is not
	// runc's, the client would also tar the rootfs into the content store.
	_, err = c.cd.TaskService().Checkpoint(ctx, &tasksapi.CheckpointTaskRequest{
		ContainerID: parent.ID(),
		Options:     opts,
	})
	res.Checkpoint = time.Since(t1)
	if b, rerr := os.ReadFile(thaw); rerr == nil && len(b) > 0 {
		if at, perr := time.Parse(time.RFC3339Nano, string(b)); perr == nil {
			thawedEarly = true
			res.Paused, res.ThawedBeforeRewrite = at.Sub(t0), true
		}
	}
	if err != nil {
		return fmt.Errorf("checkpoint: %w", errgrpc.ToNative(err))
	}
	snap, err := memfile.ReadSnapshot(imageDir)
	if err != nil {
		return fmt.Errorf("checkpoint of %s is not a LazyFork snapshot: %w", parent.ID(), err)
	}
	res.Family = snap.Family
	return nil
}

// restoreFork makes fork id: its rootfs, its container, its restored task.
func (c *Client) restoreFork(ctx context.Context, id, parentID string, info containers.Container, spec *oci.Spec,
	family, imageDir string, rfs *rootfsSource, cfg *forkConfig) (f Fork, retErr error) {
	sn := c.cd.SnapshotService(info.Snapshotter)
	base := rfs.Frozen // a fork stacks a fresh upper on the frozen layer...
	if base == "" {    // ...or on the parent's image, then copies the layer in
		pinfo, err := sn.Stat(ctx, info.SnapshotKey)
		if err != nil {
			return f, fmt.Errorf("fork %s: parent snapshot: %w", id, err)
		}
		base = pinfo.Parent
	}
	key := id
	mounts, err := sn.Prepare(ctx, key, base)
	if err != nil {
		return f, fmt.Errorf("fork %s: prepare rootfs: %w", id, err)
	}
	containerMade := false
	defer func() {
		if retErr != nil && !containerMade {
			if err := sn.Remove(context.WithoutCancel(ctx), key); err != nil {
				log.G(ctx).WithError(err).WithField("key", key).Warn("lazyfork: remove fork snapshot")
			}
		}
	}()
	if rfs.Frozen == "" {
		upper, err := upperOf(mounts)
		if err != nil {
			return f, fmt.Errorf("fork %s: %w", id, err)
		}
		if err := copyLayer(upper, rfs.UpperCopy); err != nil {
			return f, fmt.Errorf("fork %s: copy writable layer: %w", id, err)
		}
	}
	fspec, err := forkSpec(spec, parentID, id, family)
	if err != nil {
		return f, fmt.Errorf("fork %s: %w", id, err)
	}
	labels := map[string]string{
		LabelParent:   parentID,
		LabelFamily:   family,
		LabelSnapshot: imageDir,
	}
	hookDir := info.Labels[hook.Label]
	if hookDir != "" {
		// The fork's copy of the listening socket binds in its own directory.
		if err := os.MkdirAll(filepath.Join(hookDir, id), 0o755); err != nil {
			return f, fmt.Errorf("fork %s: hook dir: %w", id, err)
		}
		for i, m := range fspec.Mounts {
			if m.Destination == hook.ContainerDir {
				fspec.Mounts[i].Source = filepath.Join(hookDir, id)
			}
		}
		labels[hook.Label] = hookDir
	}

	for k, v := range cfg.labels {
		labels[k] = v
	}
	ctr, err := c.cd.NewContainer(ctx, id,
		containerd.WithImageName(info.Image),
		containerd.WithSnapshotter(info.Snapshotter),
		containerd.WithSnapshot(key),
		containerd.WithSpec(fspec),
		containerd.WithContainerLabels(labels),
		func(_ context.Context, _ *containerd.Client, ci *containers.Container) error {
			ci.Runtime = info.Runtime // same runtime, same runc options (e.g. its root)
			return nil
		},
	)
	if err != nil {
		return f, fmt.Errorf("fork %s: create container: %w", id, err)
	}
	containerMade = true
	f.Container = ctr
	t0 := time.Now()
	task, err := ctr.NewTask(ctx, cfg.io(id), containerd.WithRestoreImagePath(imageDir))
	if err != nil {
		return f, fmt.Errorf("fork %s: create task: %w", id, err)
	}
	f.Task = task
	if err := task.Start(ctx); err != nil {
		return f, fmt.Errorf("fork %s: restore: %w", id, err)
	}
	f.Restore = time.Since(t0)
	if hookDir != "" {
		if err := hook.Reseed(ctx, hook.HostSocket(hookDir, id), id, c.hookTimeout); err != nil {
			return f, fmt.Errorf("fork %s: %w", id, err)
		}
	}
	if _, err := ctr.SetLabels(ctx, map[string]string{LabelRestoreNS: strconv.FormatInt(f.Restore.Nanoseconds(), 10)}); err != nil {
		log.G(ctx).WithError(err).WithField("id", id).Warn("lazyfork: record restore time")
	}
	return f, nil
}

// removeFork deletes a fork's task, container and rootfs snapshot.
func removeFork(ctx context.Context, f Fork) {
	if f.Task != nil {
		if _, err := f.Task.Delete(ctx, containerd.WithProcessKill); err != nil && !errdefs.IsNotFound(err) {
			log.G(ctx).WithError(err).WithField("id", f.Container.ID()).Warn("lazyfork: delete fork task")
		}
	}
	if err := f.Container.Delete(ctx, containerd.WithSnapshotCleanup); err != nil && !errdefs.IsNotFound(err) {
		log.G(ctx).WithError(err).WithField("id", f.Container.ID()).Warn("lazyfork: delete fork container")
	}
}

// forkSpec is the parent's spec for fork id: its own cgroup, its family.
func forkSpec(parent *oci.Spec, parentID, id, family string) (*oci.Spec, error) {
	b, err := json.Marshal(parent)
	if err != nil {
		return nil, err
	}
	var s oci.Spec
	if err := json.Unmarshal(b, &s); err != nil {
		return nil, err
	}
	if s.Linux == nil {
		return nil, fmt.Errorf("parent spec has no linux section: %w", errdefs.ErrInvalidArgument)
	}
	s.Linux.CgroupsPath = forkCgroupsPath(s.Linux.CgroupsPath, parentID, id)
	if s.Annotations == nil {
		s.Annotations = map[string]string{}
	}
	s.Annotations[AnnotationFamily] = family
	return &s, nil
}

// forkCgroupsPath gives a fork its own cgroup beside its parent's: a restore into
// the parent's cgroup fails ("container's cgroup is not empty").
func forkCgroupsPath(p, parentID, id string) string {
	switch {
	case p == "":
		return ""
	case strings.Count(p, ":") == 2 && !strings.HasPrefix(p, "/"): // systemd slice:prefix:name
		parts := strings.SplitN(p, ":", 3)
		return parts[0] + ":" + parts[1] + ":" + id
	case filepath.Base(p) == parentID:
		return filepath.Join(filepath.Dir(p), id)
	default:
		return filepath.Join(filepath.Dir(p), id)
	}
}

// discardIO is a fork's stdio by default: pipes the shim drains into
// /dev/null. Not cio.NullIO: a process whose stdout is the host's /dev/null
// cannot be checkpointed (CRIU: "Can't lookup mount ... path=/dev/null"), so
// such a fork could not fork again.
func discardIO(string) cio.Creator { return cio.LogFile("/dev/null") }
