package client

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"os"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	tasksapi "github.com/containerd/containerd/api/services/tasks/v1"
	runcopts "github.com/containerd/containerd/api/types/runc/options"
	containerd "github.com/containerd/containerd/v2/client"
	"github.com/containerd/containerd/v2/core/containers"
	"github.com/containerd/containerd/v2/core/leases"
	"github.com/containerd/containerd/v2/core/snapshots"
	"github.com/containerd/containerd/v2/pkg/cio"
	"github.com/containerd/containerd/v2/pkg/namespaces"
	"github.com/containerd/containerd/v2/pkg/oci"
	"github.com/containerd/errdefs"
	"github.com/containerd/errdefs/pkg/errgrpc"
	"github.com/containerd/log"

	"github.com/lazyfork/lazyfork/api"
	"github.com/lazyfork/lazyfork/hook"
	"github.com/lazyfork/lazyfork/node"
	lazyforkv1 "github.com/lazyfork/lazyfork/proto/lazyfork/v1"
	snapclient "github.com/lazyfork/lazyfork/snapshotter/client"
)

// ErrCleanupIncomplete marks a failed Fork whose cleanup could not finish
// (containerd unreachable): its record stays in ROOT/ops, and Reconcile (lazyfork gc) finishes it.
var ErrCleanupIncomplete = errors.New("its cleanup is incomplete; run lazyfork gc")

// ForkOpt configures one Fork call.
type ForkOpt func(*forkConfig)

type forkConfig struct {
	ids          []string
	io           func(id string) cio.Creator
	ioGiven      bool // io is the caller's (WithIO), not the default
	keepSnapshot bool
	// claimable keeps the snapshot with its operation marker: lazyfork gc
	// removes it as an orphan unless its owner claims it (node
	// KeepSnapshot) once the owner recorded it (SnapshotForPod).
	claimable bool
	labels    map[string]string
	// stayPaused leaves a parent this call paused frozen after a successful
	// snapshot (Stop ends it without letting it run past the snapshot).
	stayPaused     bool
	maxForks       int
	restoreTimeout time.Duration
	groupSize      int
	shimJoin       bool // a group's forks join its leader's shim (shimjoin.go)
	// keptSnapshot: the forks restore a snapshot an earlier call made
	// (RestoreForks), whose batch layer they may share (forkBase).
	keptSnapshot bool
	// op is the call's operation (its record's id): what it makes is
	// labelled with it for Reconcile.
	op       string
	trace    func(id string, step ForkStep, at time.Time)
	parallel int
	// forks is how many forks the call restores from its snapshot (set by
	// Fork; the shim's SnapshotIntent).
	forks int
}

// WithParallel bounds how many forks of this call are being made at once
// (default DefaultParallel; n < 0: all of them).
func WithParallel(n int) ForkOpt { return func(c *forkConfig) { c.parallel = n } }

// DefaultParallel is how many forks of one call are made at once: 16 per
// CPU. Measured on 2 cores (bench/fork -many-only, 100 forks of a 256 MiB
// python container, the machine shared with other work): all 100 at once
// cost 5-9% more CPU per fork than 16 or 32 at a time (containerd, the
// shims and the kernel juggling 100 restores), for no shorter wall time;
// bounded, the first forks run within half a second and a fork's own
// restore (task create -> running) takes about 1 s instead of 3.
func DefaultParallel() int { return 16 * runtime.NumCPU() }

// WithShimGroup sets how many forks of the family this call's forks share a
// shim process with (default: the client's, see WithShimGroupSize).
func WithShimGroup(n int) ForkOpt { return func(c *forkConfig) { c.groupSize = n } }

// WithMax bounds the forks of this call (default: the client's, see
// WithMaxForks).
func WithMax(n int) ForkOpt { return func(c *forkConfig) { c.maxForks = n } }

// WithTimeout bounds each fork's restore in this call (default: the
// client's, see WithRestoreTimeout).
func WithTimeout(d time.Duration) ForkOpt { return func(c *forkConfig) { c.restoreTimeout = d } }

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
	// Paused is how long the parent was frozen (what its users felt),
	// including a precopy's brief freeze before the snapshot's own.
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
// nothing Fork made is left. Names and n are checked before the parent is
// touched. Concurrent calls on one parent take their snapshots one after the
// other. If the calling process dies mid-fork, what it made is listed in
// ROOT/ops, and Reconcile (run by every Fork, and by lazyfork gc) undoes it.
func (c *Client) Fork(ctx context.Context, parentID string, n int, opts ...ForkOpt) (*Result, error) {
	if n < 1 {
		return nil, fmt.Errorf("fork %s: n = %d: %w", parentID, n, errdefs.ErrInvalidArgument)
	}
	return c.fork(ctx, parentID, n, opts...)
}

func (c *Client) forkConfig(opts []ForkOpt) forkConfig {
	cfg := forkConfig{maxForks: c.maxForks, restoreTimeout: c.restoreTimeout, groupSize: c.groupSize, shimJoin: !c.noShimJoin}
	for _, o := range opts {
		o(&cfg)
	}
	cfg.ioGiven = cfg.io != nil
	if cfg.io == nil {
		cfg.io = discardIO
	}
	if cfg.restoreTimeout <= 0 {
		cfg.restoreTimeout = DefaultRestoreTimeout
	}
	if cfg.maxForks <= 0 {
		cfg.maxForks = DefaultMaxForks
	}
	return cfg
}

// forkIDs are the forks' ids: those given, else <family>-<random>.
func forkIDs(cfg *forkConfig, family string, n int) []string {
	if cfg.ids != nil {
		return cfg.ids
	}
	ids := make([]string, n)
	for i := range ids {
		ids[i] = forkID(family)
	}
	return ids
}

// fork is Fork; n = 0 takes the snapshot only (Checkpoint).
func (c *Client) fork(ctx context.Context, parentID string, n int, opts ...ForkOpt) (_ *Result, retErr error) {
	cfg := c.forkConfig(opts)
	if err := checkCount(parentID, n, cfg.maxForks); err != nil {
		return nil, err
	}
	if cfg.ids != nil && len(cfg.ids) != n {
		return nil, fmt.Errorf("fork %s: %d ids for %d forks: %w", parentID, len(cfg.ids), n, errdefs.ErrInvalidArgument)
	}
	sp, err := c.node.FreeSpace(ctx)
	if err != nil && errdefs.IsUnavailable(err) {
		return nil, fmt.Errorf("fork %s: %w", parentID, err)
	}
	if err := checkMemory(parentID, n, sp.MemAvailable); err != nil {
		return nil, err
	}
	ns, err := namespaces.NamespaceRequired(ctx)
	if err != nil {
		return nil, fmt.Errorf("fork %s: %w", parentID, err)
	}
	// Calls that died before: a parent one froze is thawed before we look.
	if _, err := c.Reconcile(ctx); err != nil {
		log.G(ctx).WithError(err).Warn("lazyfork: reconcile interrupted forks (lazyfork gc retries)")
	}

	parent, err := c.cd.LoadContainer(ctx, parentID)
	if err != nil {
		return nil, fmt.Errorf("fork %s: %w", parentID, err)
	}
	info, err := parent.Info(ctx)
	if err != nil {
		return nil, fmt.Errorf("fork %s: %w", parentID, err)
	}
	if info.Runtime.Name != api.RuntimeName {
		return nil, fmt.Errorf("fork %s: runs under %s, not %s (the memory mount must be there from creation): %w",
			parentID, info.Runtime.Name, api.RuntimeName, errdefs.ErrFailedPrecondition)
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
	// Pausing is a live task too: another fork call of it is freezing it (the
	// parent lock, taken below, waits for that call).
	if err != nil || st.Status != containerd.Running && st.Status != containerd.Paused && st.Status != containerd.Pausing {
		// A stopped container forks from the snapshot Stop kept.
		snap, serr := c.stoppedSnapshot(ctx, parentID, info.Labels)
		if serr != nil {
			return nil, fmt.Errorf("fork %s: %w", parentID, serr)
		}
		if snap != "" && n > 0 {
			forks, err := c.RestoreForks(ctx, parentID, snap, n, opts...)
			if err != nil {
				return nil, err
			}
			var took time.Duration
			for _, f := range forks {
				took = max(took, f.Restore)
			}
			return &Result{Parent: parentID, Family: info.Labels[api.LabelFamily], Snapshot: snap, Forks: forks, Restore: took}, nil
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
	family := info.Labels[api.LabelFamily]
	if family == "" {
		family = parentID
	}
	ids := forkIDs(&cfg, family, n)
	if err := c.checkIDs(ctx, parentID, ids); err != nil {
		return nil, err
	}
	if err := c.checkResources(ctx, parentID, task, n); err != nil {
		return nil, err
	}

	// The record first: from here on, whatever exists is listed in it.
	o, err := c.newOp(ctx, ns, parentID)
	if err != nil {
		return nil, fmt.Errorf("fork %s: %w", parentID, err)
	}
	defer o.release()
	frozenName := ""
	if info.Snapshotter == snapclient.SnapshotterName {
		frozenName = "lazyfork-frozen-" + o.rec.ID
	}
	// The snapshot's directory is the node's, named after the operation;
	// the record names it before it exists.
	if err := o.update(ctx, func(r *opRecord) {
		r.Snapshotter, r.Frozen = info.Snapshotter, frozenName
		r.Lease, r.Forks = leaseID(o.rec.ID), ids
	}); err != nil {
		_ = o.done(ctx)
		return nil, fmt.Errorf("fork %s: %w", parentID, err)
	}
	var snapDir, imageDir string
	rfs := &rootfsSource{}
	res := &Result{Parent: parentID}
	defer func() {
		if retErr == nil {
			return
		}
		res.Snapshot = ""
		// All or nothing: what this call made goes, the parent is thawed.
		cctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), time.Minute)
		defer cancel()
		if _, err := c.undo(cctx, o.snapshot(), false); err != nil {
			log.G(ctx).WithError(err).WithField("op", o.rec.ID).Warn("lazyfork: cleanup of a failed fork is incomplete; lazyfork gc finishes it")
			retErr = fmt.Errorf("%w (%w: %v)", retErr, ErrCleanupIncomplete, err)
			return
		}
		_ = o.done(cctx)
	}()

	ctx, err = c.withOpLease(ctx, o.rec.ID)
	if err != nil {
		return nil, fmt.Errorf("fork %s: lease: %w", parentID, err)
	}
	// A directory made before the record names it holds the operation's
	// marker: undo finds it by that.
	snapDir, imageDir, err = c.node.PrepareSnapshot(ctx, o.rec.ID)
	if err != nil {
		return nil, fmt.Errorf("fork %s: snapshot directory: %w", parentID, err)
	}
	res.Snapshot = imageDir
	if err := o.update(ctx, func(r *opRecord) { r.SnapshotDir, r.ImageDir = snapDir, imageDir }); err != nil {
		return nil, fmt.Errorf("fork %s: %w", parentID, err)
	}

	// The snapshot phase, one call at a time per parent: the parent's state
	// is read under the lock (another call's pause is not the caller's).
	unlock, err := c.lockParent(ctx, ns, parentID)
	if err != nil {
		return nil, fmt.Errorf("fork %s: %w", parentID, err)
	}
	st, err = task.Status(ctx)
	if err == nil && st.Status != containerd.Running && st.Status != containerd.Paused {
		err = fmt.Errorf("its task is %s: %w", st.Status, errdefs.ErrFailedPrecondition)
	}
	if err == nil {
		cfg.forks = n
		err = c.snapshot(ctx, o, parent, info, task, st.Status == containerd.Paused, imageDir, frozenName, rfs, &cfg, res)
	}
	unlock()
	if err != nil {
		return nil, fmt.Errorf("fork %s: %w", parentID, err)
	}
	rfs.Snapshotter = info.Snapshotter
	rfs.Namespace = ns
	if err := c.node.SetRootfs(ctx, snapDir, rfs); err != nil {
		return nil, fmt.Errorf("fork %s: %w", parentID, err)
	}

	if n > 0 {
		cfg.op = o.rec.ID
		forks, restore, err := c.restoreForks(ctx, parentID, info, spec, res.Family, imageDir, rfs, ids, &cfg)
		if err != nil {
			return nil, fmt.Errorf("fork %s: %w", parentID, err)
		}
		res.Forks, res.Restore = forks, restore
	}

	// Success: the forks and a kept snapshot are owned by their containers
	// (and the caller) now; the record stops naming them before the lease goes.
	if cfg.keepSnapshot && !cfg.claimable {
		if err := c.node.KeepSnapshot(ctx, snapDir); err != nil {
			return nil, fmt.Errorf("fork %s: %w", parentID, err)
		}
	}
	if err := o.update(ctx, func(r *opRecord) {
		r.Forks, r.Paused, r.Frozen = nil, false, ""
		if cfg.keepSnapshot {
			r.SnapshotDir = ""
		}
	}); err != nil {
		return nil, fmt.Errorf("fork %s: %w", parentID, err)
	}
	c.finishOp(context.WithoutCancel(ctx), o, cfg.keepSnapshot)
	return res, nil
}

// finishOp ends a successful operation: the snapshot directory unless kept,
// the lease, the record. What fails stays in the record for Reconcile.
func (c *Client) finishOp(ctx context.Context, o *op, keep bool) {
	ok := true
	if !keep && o.rec.SnapshotDir != "" {
		if err := c.node.RemoveSnapshot(ctx, o.rec.SnapshotDir); err != nil {
			log.G(ctx).WithError(err).WithField("snapshot", o.rec.SnapshotDir).Warn("lazyfork: remove snapshot (lazyfork gc retries)")
			ok = false
		}
	}
	if err := c.deleteLease(ctx, o.rec.Lease); err != nil {
		log.G(ctx).WithError(err).WithField("lease", o.rec.Lease).Warn("lazyfork: delete lease (lazyfork gc retries)")
		ok = false
	}
	if ok {
		_ = o.done(ctx)
	}
}

// leaseID is the containerd lease of operation op.
func leaseID(op string) string { return "lazyfork-op-" + op }

// withOpLease creates operation op's lease (labelled api.LabelOp, expiring after
// 24 h at the latest) and returns ctx carrying it: the forks' fresh
// snapshots stay out of containerd's GC until their containers reference them.
func (c *Client) withOpLease(ctx context.Context, op string) (context.Context, error) {
	l, err := c.cd.LeasesService().Create(ctx, leases.WithID(leaseID(op)),
		leases.WithExpiration(24*time.Hour), leases.WithLabel(api.LabelOp, op))
	if err != nil {
		return ctx, err
	}
	return leases.WithLease(ctx, l.ID), nil
}

func (c *Client) deleteLease(ctx context.Context, id string) error {
	if id == "" {
		return nil
	}
	err := c.cd.LeasesService().Delete(ctx, leases.Lease{ID: id})
	if err != nil && !errdefs.IsNotFound(err) {
		return err
	}
	return nil
}

// RestoreForks restores n more forks of parentID from a snapshot kept by Fork
// (KeepSnapshot; imageDir is its Result.Snapshot). The parent container must
// still exist (its spec, image and runtime are cloned); its task need not run.
// On error nothing is left of the forks.
func (c *Client) RestoreForks(ctx context.Context, parentID, imageDir string, n int, opts ...ForkOpt) (_ []Fork, retErr error) {
	cfg := c.forkConfig(opts)
	if n < 1 || cfg.ids != nil && len(cfg.ids) != n {
		return nil, fmt.Errorf("restore forks of %s: n = %d, %d ids: %w", parentID, n, len(cfg.ids), errdefs.ErrInvalidArgument)
	}
	if err := checkCount(parentID, n, cfg.maxForks); err != nil {
		return nil, err
	}
	ns, err := namespaces.NamespaceRequired(ctx)
	if err != nil {
		return nil, err
	}
	snap, err := c.node.Snapshot(ctx, imageDir)
	if err != nil {
		return nil, fmt.Errorf("restore forks of %s: snapshot %s: %w", parentID, imageDir, err)
	}
	rfs := snap.Rootfs
	if rfs == nil {
		return nil, fmt.Errorf("restore forks of %s: snapshot %s has no rootfs record (not made by Fork?): %w", parentID, imageDir, errdefs.ErrNotFound)
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
	ids := forkIDs(&cfg, snap.Family, n)
	if err := c.checkIDs(ctx, parentID, ids); err != nil {
		return nil, err
	}
	if err := c.checkResources(ctx, parentID, nil, n); err != nil {
		return nil, err
	}
	o, err := c.newOp(ctx, ns, parentID)
	if err != nil {
		return nil, fmt.Errorf("restore forks of %s: %w", parentID, err)
	}
	defer o.release()
	if err := o.update(ctx, func(r *opRecord) {
		r.ImageDir, r.Snapshotter, r.Lease, r.Forks = imageDir, info.Snapshotter, leaseID(o.rec.ID), ids
	}); err != nil {
		_ = o.done(ctx)
		return nil, fmt.Errorf("restore forks of %s: %w", parentID, err)
	}
	defer func() {
		if retErr == nil {
			return
		}
		cctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), time.Minute)
		defer cancel()
		if _, err := c.undo(cctx, o.snapshot(), false); err != nil {
			retErr = fmt.Errorf("%w (%w: %v)", retErr, ErrCleanupIncomplete, err)
			return
		}
		_ = o.done(cctx)
	}()
	ctx, err = c.withOpLease(ctx, o.rec.ID)
	if err != nil {
		return nil, fmt.Errorf("restore forks of %s: lease: %w", parentID, err)
	}
	cfg.keptSnapshot, cfg.op = true, o.rec.ID
	forks, _, err := c.restoreForks(ctx, parentID, info, spec, snap.Family, imageDir, rfs, ids, &cfg)
	if err != nil {
		return nil, fmt.Errorf("restore forks of %s: %w", parentID, err)
	}
	if err := o.update(ctx, func(r *opRecord) { r.Forks = nil }); err != nil {
		return nil, fmt.Errorf("restore forks of %s: %w", parentID, err)
	}
	c.finishOp(context.WithoutCancel(ctx), o, true)
	return forks, nil
}

// restoreForks makes the forks ids, cfg's parallel of them at a time, all on
// one base made for the batch (forkBase); if any fails, no more begin and
// all are removed.
func (c *Client) restoreForks(ctx context.Context, parentID string, info containers.Container, spec *oci.Spec,
	family, imageDir string, rfs *rootfsSource, ids []string, cfg *forkConfig) ([]Fork, time.Duration, error) {
	n := len(ids)
	forks := make([]Fork, n)
	errs := make([]error, n)
	start := time.Now()
	// What every fork stacks its rootfs on, made once for the batch.
	base, removeBase, err := c.forkBase(ctx, info, imageDir, rfs, cfg.keptSnapshot)
	if err != nil {
		return nil, time.Since(start), err
	}
	specJSON, err := json.Marshal(spec)
	if err != nil {
		if removeBase != nil {
			removeBase(context.WithoutCancel(ctx))
		}
		return nil, time.Since(start), fmt.Errorf("parent spec: %w", err)
	}
	groupSize := max(cfg.groupSize, 1)
	groupName := func(k int) string { return fmt.Sprintf("%s-%s-%d", family, filepath.Base(filepath.Dir(imageDir)), k) }
	groups, joins := c.shimGroups(ctx, ids, groupSize, groupName, family, info, spec.Annotations, cfg)
	defer c.closeGroupSandboxes(ctx, joins)
	var first sync.Once
	var wg sync.WaitGroup
	parallel := cfg.parallel
	if parallel == 0 {
		parallel = DefaultParallel()
	}
	if parallel < 0 || parallel > n {
		parallel = n
	}
	slots := make(chan struct{}, parallel)
	var failed atomic.Bool // all or nothing: once one failed, no more begin
	for i := range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			join := forkJoin{}
			if j := joins[i/groupSize]; j != nil {
				if ids[i] == j.leader {
					j.open(ctx, c, info.Runtime.Name, cfg.op)
					join.created = func() { j.release(true) }
					defer j.release(false) // a leader that failed lets its group go (to fail)
				} else {
					// Before a slot: the leader must get one.
					select {
					case <-j.ready:
					case <-ctx.Done():
						errs[i] = fmt.Errorf("fork %s: %w", ids[i], ctx.Err())
						return
					}
					join.sandbox = j.sandbox
				}
			}
			select {
			case slots <- struct{}{}:
			case <-ctx.Done():
				errs[i] = fmt.Errorf("fork %s: %w", ids[i], ctx.Err())
				return
			}
			defer func() { <-slots }()
			if failed.Load() {
				return // the batch fails with the error of the fork that did
			}
			defer func() {
				if errs[i] != nil {
					failed.Store(true)
				}
			}()
			cfg.step(ids[i], StepQueued)
			forks[i], errs[i] = c.restoreFork(ctx, ids[i], parentID, info, specJSON, family, groups[i/groupSize], imageDir, base, join, cfg)
			if errs[i] == nil {
				first.Do(func() { errs[i] = failpoint(ctx, FailAfterFirstFork) })
			}
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
		if removeBase != nil {
			removeBase(context.WithoutCancel(ctx))
		}
		return nil, took, err
	}
	return forks, took, nil
}

// tellSnapshotIntent tells the parent's shim how many forks the snapshot its
// next Pause begins is for (lazyforkv1.SnapshotIntent): for many, a heap its
// moves fragmented is consolidated first, while it runs, so that the forks
// map it whole. inShim: the call resumes the parent itself, so the shim may
// freeze it without runc (freeze_in_shim). Only a hint: a shim that does not
// take it (runc's refuses the update, changing nothing) costs the call
// nothing.
func (c *Client) tellSnapshotIntent(ctx context.Context, id string, forks int, inShim bool) {
	res, err := api.MarshalSnapshotIntent(&lazyforkv1.SnapshotIntent{Forks: uint32(min(forks, math.MaxUint32)), FreezeInShim: inShim})
	if err == nil {
		_, err = c.cd.TaskService().Update(ctx, &tasksapi.UpdateTaskRequest{ContainerID: id, Resources: res})
	}
	if err != nil {
		log.G(ctx).WithError(err).WithField("id", id).Debug("lazyfork: the shim did not take the snapshot intent")
	}
}

// snapshot freezes the parent, checkpoints it through the shim, captures its
// writable layer (a frozen layer on LazyFork's snapshotter, else a copy aside),
// and thaws it again (whatever happened, unless the caller had it paused
// already).
func (c *Client) snapshot(ctx context.Context, o *op, parent containerd.Container, info containers.Container, task containerd.Task,
	wasPaused bool, imageDir, frozenName string, rfs *rootfsSource, cfg *forkConfig, res *Result) (retErr error) {
	if !wasPaused {
		// Told before the layer's copy: the shim starts the snapshot's move
		// helper meanwhile. A parent Stop leaves frozen stays paused as
		// runc's shim sees it.
		c.tellSnapshotIntent(ctx, parent.ID(), cfg.forks, !cfg.stayPaused)
	}
	var pending *snapclient.PendingFreeze
	if info.Snapshotter == snapclient.SnapshotterName {
		// The bulk of the layer copy happens before the pause; Commit only
		// catches up with what changed meanwhile.
		var labels map[string]string
		if cfg.keepSnapshot {
			labels = map[string]string{gcRootLabel: time.Now().UTC().Format(time.RFC3339)}
		}
		p, err := snapclient.StartFreeze(ctx, c.cd.SnapshotService(info.Snapshotter), info.SnapshotKey, frozenName, snapshots.WithLabels(labels))
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
	if dir := info.Labels[api.LabelHook]; dir != "" && !wasPaused {
		if err := hook.Quiesce(ctx, hook.HostSocket(dir, parent.ID()), c.hookTimeout); err != nil {
			return fmt.Errorf("quiesce: %w", err)
		}
	}
	t0 := time.Now()
	thawedEarly := false
	if !wasPaused {
		// Recorded before the pause: a call that dies paused is thawed.
		if err := o.update(ctx, func(r *opRecord) { r.Paused = true }); err != nil {
			return err
		}
		if err := task.Pause(ctx); err != nil {
			return fmt.Errorf("pause: %w", err)
		}
		defer func() {
			if cfg.stayPaused && retErr == nil {
				res.Paused = time.Since(t0)
				return
			}
			if err := failpoint(ctx, FailBeforeResume); err != nil {
				retErr = errors.Join(retErr, err)
			}
			if err := task.Resume(context.WithoutCancel(ctx)); err != nil {
				retErr = errors.Join(retErr, fmt.Errorf("resume parent: %w", err))
			}
			if !thawedEarly {
				res.Paused = time.Since(t0)
			}
		}()
	}
	if err := failpoint(ctx, FailAfterPause); err != nil {
		return err
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
		if err := failpoint(ctx, FailAfterFreeze); err != nil {
			return err
		}
	} else {
		if _, ok := c.node.(*node.Local); !ok {
			return fmt.Errorf("the writable layer of %s is on snapshotter %s: forking it copies the layer with files of the node, which a client of the node API cannot do; create it on LazyFork's snapshotter (%s, lazyfork setup starts it), or fork on the node with the root's files (--root, client.WithRoot): %w",
				parent.ID(), info.Snapshotter, snapclient.SnapshotterName, errdefs.ErrNotImplemented)
		}
		mounts, err := c.cd.SnapshotService(info.Snapshotter).Mounts(ctx, info.SnapshotKey)
		if err != nil {
			return fmt.Errorf("mounts of snapshot %s: %w", info.SnapshotKey, err)
		}
		upper, err := upperOf(mounts)
		if err != nil {
			return err
		}
		// A fork's overlay stacks on its batch's layer: the copy holds that
		// layer too, so it is all that lies above the parent's image. (A
		// snapshotter without overlays gives the whole tree as the upper.)
		lower, release := "", func() {}
		if isOverlay(mounts) {
			if lower, release, err = c.batchLayerDir(ctx, info); err != nil {
				return err
			}
		}
		rfs.UpperCopy = filepath.Join(filepath.Dir(imageDir), "upper")
		err = copyLayers(rfs.UpperCopy, lower, upper)
		release()
		if err != nil {
			return fmt.Errorf("copy writable layer of %s: %w", parent.ID(), err)
		}
	}
	res.CopyUpper = time.Since(t2)

	// A task paused here is thawed by the shim once its dump is done, while
	// the memory files are written; a task the caller had paused stays
	// paused.
	opts, err := api.MarshalCheckpointOptions(&runcopts.CheckpointOptions{ImagePath: imageDir},
		&lazyforkv1.CheckpointOptions{ThawAfterDump: !wasPaused && !cfg.stayPaused})
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
	if err != nil {
		return fmt.Errorf("checkpoint: %w", errgrpc.ToNative(err))
	}
	snap, err := c.node.Snapshot(ctx, imageDir)
	if err != nil {
		return fmt.Errorf("checkpoint of %s is not a LazyFork snapshot: %w", parent.ID(), err)
	}
	// The shim records in the snapshot's source when it thawed the task.
	if !snap.Thawed.IsZero() {
		thawedEarly = true
		res.Paused, res.ThawedBeforeRewrite = snap.Thawed.Sub(t0), true
		if snap.Paused > 0 {
			// The shim's own account: its Pause may have copied a
			// fragmented heap first, the parent running (a consolidation).
			res.Paused = snap.Paused
		}
	}
	if err := failpoint(ctx, FailAfterCheckpt); err != nil {
		return err
	}
	res.Family = snap.Family
	return nil
}

// restoreFork makes fork id: its rootfs (a fresh upper on base, see
// forkBase), its container, its restored task.
func (c *Client) restoreFork(ctx context.Context, id, parentID string, info containers.Container, specJSON []byte,
	family, group, imageDir, base string, join forkJoin, cfg *forkConfig) (f Fork, retErr error) {
	sn := c.cd.SnapshotService(info.Snapshotter)
	key := id
	if _, err := sn.Prepare(ctx, key, base); err != nil {
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
	cfg.step(id, StepRootfs)
	fspec, err := forkSpecJSON(specJSON, parentID, id, family, group)
	if err != nil {
		return f, fmt.Errorf("fork %s: %w", id, err)
	}
	labels := map[string]string{
		api.LabelParent:   parentID,
		api.LabelFamily:   family,
		api.LabelSnapshot: imageDir,
	}
	hookDir := info.Labels[api.LabelHook]
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
		labels[api.LabelHook] = hookDir
	}

	// A fork of nerdctl's container is nerdctl's too (its own name, state
	// and log), so nerdctl's hooks and commands act on it, not its parent.
	var nf *nerdctlFork
	if isNerdctl(info.Labels) {
		if nf, err = prepareNerdctlFork(info.Labels, fspec, parentID, id, len(cfg.ids) > 0); err != nil {
			return f, fmt.Errorf("fork %s: %w", id, err)
		}
		defer func() {
			if retErr != nil {
				nf.remove()
			}
		}()
		for k, v := range nf.labels {
			labels[k] = v
		}
	}
	for k, v := range cfg.labels {
		labels[k] = v
	}
	labels[api.LabelShimGroup] = group // a later call's forks of the group find its shim (shimjoin.go)
	newContainer := func(sandbox string) (containerd.Container, error) {
		return c.cd.NewContainer(ctx, id,
			containerd.WithImageName(info.Image),
			containerd.WithSnapshotter(info.Snapshotter),
			containerd.WithSnapshot(key),
			containerd.WithSpec(fspec),
			containerd.WithContainerLabels(labels),
			func(_ context.Context, _ *containerd.Client, ci *containers.Container) error {
				ci.Runtime = info.Runtime // same runtime, same runc options (e.g. its root)
				ci.SandboxID = sandbox    // its group leader's shim, without a shim start (shimjoin.go)
				return nil
			},
		)
	}
	ctr, err := newContainer(join.sandbox)
	if err != nil {
		return f, fmt.Errorf("fork %s: create container: %w", id, err)
	}
	containerMade = true
	f.Container = ctr
	cfg.step(id, StepContainer)
	t0 := time.Now()
	// The restore is bounded: a CRIU restore that never ends (a damaged
	// image) must not hold the call forever.
	rctx, cancel := context.WithTimeout(ctx, cfg.restoreTimeout)
	defer cancel()
	timedOut := func(err error) error {
		if rctx.Err() != context.DeadlineExceeded || ctx.Err() != nil {
			return err
		}
		where := "the task's bundle, work/restore.log (removed with the fork)"
		ns, _ := namespaces.Namespace(ctx)
		if p, err := c.node.SaveRestoreLog(context.WithoutCancel(ctx), ns, id); err == nil && p != "" {
			where = p
		}
		return fmt.Errorf("restore did not finish within %v and was stopped (raise the bound with --timeout or client.WithRestoreTimeout); CRIU's restore log: %s: %w",
			cfg.restoreTimeout, where, context.DeadlineExceeded)
	}
	ioc := cfg.io(id)
	if nf != nil && !cfg.ioGiven && nf.io() != nil {
		ioc = nf.io() // nerdctl's logging driver: nerdctl logs reads it
	}
	task, err := ctr.NewTask(rctx, ioc, containerd.WithRestoreImagePath(imageDir))
	if err != nil && join.sandbox != "" && rctx.Err() == nil {
		// The leader's shim went (its task deleted, its shim exiting): a
		// fork's create only records it (the restore is at Start), so this
		// is the join failing; the usual path, with a container record
		// that names no sandbox (the field is immutable).
		log.G(ctx).WithError(err).WithFields(log.Fields{"id": id, "leader": join.sandbox}).Info("lazyfork: shim group's leader gone; the fork starts its shim the usual way")
		if derr := ctr.Delete(context.WithoutCancel(ctx)); derr == nil {
			ctr, err = newContainer("")
			if err != nil {
				containerMade = false // the rootfs snapshot is removed on return
				f.Container = nil
				return f, fmt.Errorf("fork %s: create container: %w", id, err)
			}
			f.Container = ctr
			task, err = ctr.NewTask(rctx, ioc, containerd.WithRestoreImagePath(imageDir))
		}
	}
	if err != nil {
		return f, fmt.Errorf("fork %s: create task: %w", id, timedOut(err))
	}
	f.Task = task
	if join.created != nil {
		join.created()
	}
	cfg.step(id, StepCreate)
	if err := task.Start(rctx); err != nil {
		return f, fmt.Errorf("fork %s: restore: %w", id, timedOut(err))
	}
	f.Restore = time.Since(t0)
	cfg.step(id, StepStart)
	if hookDir != "" {
		if err := hook.Reseed(ctx, hook.HostSocket(hookDir, id), id, c.hookTimeout); err != nil {
			return f, fmt.Errorf("fork %s: %w", id, err)
		}
	}
	if _, err := ctr.SetLabels(ctx, map[string]string{api.LabelRestoreNS: strconv.FormatInt(f.Restore.Nanoseconds(), 10)}); err != nil {
		log.G(ctx).WithError(err).WithField("id", id).Warn("lazyfork: record restore time")
	}
	cfg.step(id, StepDone)
	return f, nil
}

// removeFork deletes a fork's task (also one whose create did not return),
// container and rootfs snapshot.
func removeFork(ctx context.Context, f Fork) {
	labels, _ := f.Container.Labels(ctx)
	defer func() {
		if err := removeNerdctlState(f.Container.ID(), labels); err != nil {
			log.G(ctx).WithError(err).WithField("id", f.Container.ID()).Warn("lazyfork: remove fork's nerdctl state")
		}
	}()
	if err := deleteTask(ctx, f.Container); err != nil {
		log.G(ctx).WithError(err).WithField("id", f.Container.ID()).Warn("lazyfork: delete fork task")
	}
	if err := f.Container.Delete(ctx, containerd.WithSnapshotCleanup); err != nil && !errdefs.IsNotFound(err) {
		log.G(ctx).WithError(err).WithField("id", f.Container.ID()).Warn("lazyfork: delete fork container")
	}
}

// forkSpec is the parent's spec for fork id: its own cgroup, its family.
func forkSpec(parent *oci.Spec, parentID, id, family, group string) (*oci.Spec, error) {
	b, err := json.Marshal(parent)
	if err != nil {
		return nil, err
	}
	return forkSpecJSON(b, parentID, id, family, group)
}

// forkSpecJSON is forkSpec of the parent's spec in JSON (marshalled once
// for a batch).
func forkSpecJSON(b []byte, parentID, id, family, group string) (*oci.Spec, error) {
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
	s.Annotations[api.AnnotationFamily] = family
	if group != "" {
		s.Annotations[api.AnnotationShimGroup] = group
	}
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
