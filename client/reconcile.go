package client

import (
	"context"
	"errors"
	"fmt"
	"path/filepath"
	"strings"
	"time"

	containerd "github.com/containerd/containerd/v2/client"
	"github.com/containerd/containerd/v2/core/leases"
	"github.com/containerd/containerd/v2/core/snapshots"
	"github.com/containerd/containerd/v2/pkg/namespaces"
	"github.com/containerd/errdefs"

	"github.com/lazyfork/lazyfork/api"
	"github.com/lazyfork/lazyfork/node"
)

// Report lists what Reconcile or GC removed (or, dry, would remove), one
// line per object: "thawed NS/ID", "fork NS/ID", "frozen layer NAME",
// "rootfs snapshot NAME", "snapshot dir DIR", "lease NS/ID", "op record ID",
// "lock FILE", "sandbox record NS/ID".
type Report struct {
	Removed []string
}

func (r *Report) add(format string, args ...any) {
	r.Removed = append(r.Removed, fmt.Sprintf(format, args...))
}

// Reconcile undoes the Fork calls whose process died before they ended (their
// records in ROOT/ops): it thaws a parent such a call paused, removes the
// forks it made, its frozen layer, its snapshot directory and its lease, then
// its record. It is idempotent and tolerates missing pieces; what it cannot
// do now (containerd unreachable) is returned as an error, and the record
// stays for the next run. Fork runs it first; lazyfork gc too.
func (c *Client) Reconcile(ctx context.Context) (Report, error) {
	return c.reconcile(ctx, false)
}

func (c *Client) reconcile(ctx context.Context, dry bool) (Report, error) {
	var rep Report
	ops, err := c.node.Ops(ctx)
	errs := []error{err}
	for _, st := range ops {
		if st.Alive {
			continue
		}
		rec := st.Record
		r, err := c.undo(ctx, &rec, dry)
		rep.Removed = append(rep.Removed, r.Removed...)
		if err != nil {
			errs = append(errs, fmt.Errorf("interrupted fork of %s/%s (record %s): %w", rec.Namespace, rec.Parent, rec.ID, err))
			continue
		}
		rep.add("op record %s", rec.ID)
		if !dry {
			if err := c.node.RemoveOp(ctx, rec.ID); err != nil {
				errs = append(errs, err)
			}
		}
	}
	return rep, errors.Join(errs...)
}

// undo removes what the operation rec lists and thaws its parent if it
// paused it; each step tolerates what is already gone. dry only reports.
func (c *Client) undo(ctx context.Context, rec *opRecord, dry bool) (Report, error) {
	var rep Report
	ctx = namespaces.WithNamespace(ctx, rec.Namespace)
	if c.cd == nil {
		return rep, fmt.Errorf("no containerd connection: %w", errdefs.ErrUnavailable)
	}
	var errs []error
	// The forks first: they stack on the frozen layer.
	for _, id := range rec.Forks {
		removed, err := c.removeOpFork(ctx, rec, id, dry)
		if removed {
			rep.add("fork %s/%s", rec.Namespace, id)
		}
		if err != nil {
			errs = append(errs, fmt.Errorf("fork %s: %w", id, err))
		}
	}
	// The records that joined its shim groups to their leaders' shims.
	if len(errs) == 0 {
		sbs, err := c.removeOpSandboxes(ctx, rec.ID, dry)
		for _, id := range sbs {
			rep.add("sandbox record %s/%s", rec.Namespace, id)
		}
		if err != nil {
			errs = append(errs, fmt.Errorf("sandbox records: %w", err))
		}
	}
	if rec.Paused {
		thawed, err := c.thawParent(ctx, rec, dry)
		if thawed {
			rep.add("thawed %s/%s", rec.Namespace, rec.Parent)
		}
		if err != nil {
			errs = append(errs, fmt.Errorf("thaw parent %s: %w", rec.Parent, err))
		}
	}
	if rec.Snapshotter != "" && rec.Frozen != "" {
		sn := c.cd.SnapshotService(rec.Snapshotter)
		// A freeze in progress is a snapshot named after the frozen layer.
		var names []string
		err := sn.Walk(ctx, func(_ context.Context, i snapshots.Info) error {
			if i.Name == rec.Frozen || strings.HasPrefix(i.Name, rec.Frozen+"-freezing-") {
				names = append(names, i.Name)
			}
			return nil
		})
		if err != nil {
			errs = append(errs, fmt.Errorf("list snapshots of %s: %w", rec.Snapshotter, err))
		}
		for _, name := range names {
			if !dry {
				if err := sn.Remove(ctx, name); err != nil && !errdefs.IsNotFound(err) {
					errs = append(errs, fmt.Errorf("remove frozen layer %s: %w", name, err))
					continue
				}
			}
			rep.add("frozen layer %s", name)
		}
	}
	// The operation's snapshot directory: the one its record names, or one
	// made before the record named it (it holds the operation's marker).
	if dirs, err := c.node.SnapshotDirs(ctx); err != nil {
		errs = append(errs, fmt.Errorf("list snapshot dirs: %w", err))
	} else {
		for _, d := range dirs {
			if d.Dir != rec.SnapshotDir && (d.Op != rec.ID || rec.ID == "") {
				continue
			}
			if !dry {
				if err := c.node.RemoveSnapshot(ctx, d.Dir); err != nil {
					errs = append(errs, fmt.Errorf("remove snapshot dir %s: %w", d.Dir, err))
					continue
				}
			}
			rep.add("snapshot dir %s", d.Dir)
		}
	}
	if rec.Lease != "" {
		ls, err := c.cd.LeasesService().List(ctx, fmt.Sprintf("id==%q", rec.Lease))
		if err != nil {
			errs = append(errs, fmt.Errorf("list leases: %w", err))
		}
		for _, l := range ls {
			if !dry {
				if err := c.cd.LeasesService().Delete(ctx, l, leases.SynchronousDelete); err != nil && !errdefs.IsNotFound(err) {
					errs = append(errs, fmt.Errorf("delete lease %s: %w", l.ID, err))
					continue
				}
			}
			rep.add("lease %s/%s", rec.Namespace, l.ID)
		}
	}
	return rep, errors.Join(errs...)
}

// removeOpFork removes fork id of operation rec if it is the operation's (it
// restores from rec's image), or its rootfs snapshot if no container was made.
func (c *Client) removeOpFork(ctx context.Context, rec *opRecord, id string, dry bool) (bool, error) {
	ctr, err := c.cd.LoadContainer(ctx, id)
	if errdefs.IsNotFound(err) {
		// Prepared but no container yet: its rootfs snapshot.
		if rec.Snapshotter == "" {
			return false, nil
		}
		sn := c.cd.SnapshotService(rec.Snapshotter)
		if _, err := sn.Stat(ctx, id); errdefs.IsNotFound(err) {
			return false, nil
		} else if err != nil {
			return false, err
		}
		if dry {
			return true, nil
		}
		if err := sn.Remove(ctx, id); err != nil && !errdefs.IsNotFound(err) {
			return false, err
		}
		return true, nil
	}
	if err != nil {
		return false, err
	}
	labels, err := ctr.Labels(ctx)
	if err != nil {
		return false, err
	}
	if labels[api.LabelParent] != rec.Parent || rec.ImageDir == "" || labels[api.LabelSnapshot] != rec.ImageDir {
		return false, nil // a container of that name that is not this fork
	}
	if dry {
		return true, nil
	}
	if err := c.Delete(ctx, id); err != nil && !errdefs.IsNotFound(err) {
		return false, err
	}
	return true, nil
}

// thawParent resumes the parent of a dead operation that paused it, unless a
// live fork of it holds its lock (then the pause is that fork's).
func (c *Client) thawParent(ctx context.Context, rec *opRecord, dry bool) (bool, error) {
	unlock, ok, err := c.tryLockParent(ctx, rec.Namespace, rec.Parent)
	if err != nil {
		return false, err
	}
	if !ok {
		return false, nil
	}
	defer unlock()
	ctr, err := c.cd.LoadContainer(ctx, rec.Parent)
	if errdefs.IsNotFound(err) {
		return false, nil
	}
	if err != nil {
		return false, err
	}
	task, err := ctr.Task(ctx, nil)
	if errdefs.IsNotFound(err) {
		return false, nil
	}
	if err != nil {
		return false, err
	}
	st, err := task.Status(ctx)
	if err != nil {
		return false, err
	}
	if st.Status != containerd.Paused {
		return false, nil
	}
	if dry {
		return true, nil
	}
	if err := task.Resume(ctx); err != nil {
		return false, err
	}
	return true, nil
}

// OrphanAge is how old a snapshot directory without a live operation must be
// before GC removes it.
const OrphanAge = time.Minute

// UnclaimedAge is how old a snapshot directory marked node.UnclaimedOp must
// be before lazyfork gc takes it: it counts from the last step of its making
// (the shim renews the directory's time after a long unpack).
const UnclaimedAge = 10 * time.Minute

// GC is Reconcile, then a sweep for orphans no record names: snapshot
// directories a Fork made (they hold its op marker) that no live operation
// and no container label (api.LabelSnapshot, api.LabelStopped, in any namespace)
// references and that are older than OrphanAge, leases labelled api.LabelOp
// whose operation is over, and parent locks of containers that are gone;
// then the memory store's GC (node.CollectMemory). dry reports without
// removing (and without the memory store's GC).
func (c *Client) GC(ctx context.Context, dry bool) (Report, error) {
	rep, err := c.reconcile(ctx, dry)
	errs := []error{err}
	live := map[string]bool{}   // operations still running
	record := map[string]bool{} // operations with a record
	if ops, err := c.node.Ops(ctx); err == nil {
		for _, o := range ops {
			record[o.Record.ID] = true
			if o.Alive {
				live[o.Record.ID] = true
			}
		}
	} else {
		return rep, errors.Join(append(errs, fmt.Errorf("list operations: %w", err))...)
	}
	nss, err := c.cd.NamespaceService().List(ctx)
	if err != nil {
		return rep, errors.Join(append(errs, fmt.Errorf("list namespaces: %w", err))...)
	}
	used := map[string]bool{} // snapshot dirs containers reference
	var locks []string        // locks of containers that exist
	for _, ns := range nss {
		nctx := namespaces.WithNamespace(ctx, ns)
		ctrs, err := c.cd.ContainerService().List(nctx)
		if err != nil {
			return rep, errors.Join(append(errs, fmt.Errorf("list containers of %s: %w", ns, err))...)
		}
		for _, x := range ctrs {
			locks = append(locks, node.ParentLock(ns, x.ID))
			for _, l := range []string{api.LabelSnapshot, api.LabelStopped} {
				if v := x.Labels[l]; v != "" {
					used[filepath.Dir(filepath.Clean(v))] = true
				}
			}
		}
		ls, err := c.cd.LeasesService().List(nctx)
		if err != nil {
			errs = append(errs, fmt.Errorf("list leases of %s: %w", ns, err))
			continue
		}
		for _, l := range ls {
			op := l.Labels[api.LabelOp]
			if op == "" || live[op] || record[op] {
				continue // running, or its record is being reconciled
			}
			if !dry {
				if err := c.cd.LeasesService().Delete(nctx, l, leases.SynchronousDelete); err != nil && !errdefs.IsNotFound(err) {
					errs = append(errs, fmt.Errorf("delete lease %s: %w", l.ID, err))
					continue
				}
			}
			rep.add("lease %s/%s", ns, l.ID)
		}
	}
	// Locks of containers that are gone (ctr or nerdctl removed them) and
	// of operations that are over, unless held right now.
	removed, err := c.node.SweepLocks(ctx, locks, dry)
	if err != nil {
		errs = append(errs, fmt.Errorf("sweep locks: %w", err))
	}
	for _, name := range removed {
		rep.add("lock %s", name)
	}
	dirs, err := c.node.SnapshotDirs(ctx)
	if err != nil {
		errs = append(errs, fmt.Errorf("list snapshot dirs: %w", err))
	}
	for _, d := range dirs {
		if d.Op == "" {
			continue // not a Fork's, or kept: owned elsewhere
		}
		age := OrphanAge
		if d.Op == node.UnclaimedOp {
			age = UnclaimedAge
		}
		if live[d.Op] || used[d.Dir] || record[d.Op] || time.Since(d.ModTime) < age {
			continue
		}
		if !dry {
			if rfs := d.Rootfs; rfs != nil && rfs.Frozen != "" {
				fctx := ctx
				if rfs.Namespace != "" {
					fctx = namespaces.WithNamespace(ctx, rfs.Namespace)
				}
				if err := c.cd.SnapshotService(rfs.Snapshotter).Remove(fctx, rfs.Frozen); err == nil {
					rep.add("frozen layer %s", rfs.Frozen)
				}
			}
			if err := c.node.RemoveSnapshot(ctx, d.Dir); err != nil {
				errs = append(errs, err)
				continue
			}
		}
		rep.add("snapshot dir %s", d.Dir)
	}
	// Last, once the snapshot dirs above dropped their references: memory
	// references whose holder is gone, such as a fork's whose shim died
	// while creating its task (the shim's delete, run as the failed create
	// removes the bundle, may find nothing to drop), with what only they
	// pinned.
	if !dry {
		freed, err := c.node.CollectMemory(ctx)
		if err != nil {
			errs = append(errs, fmt.Errorf("collect memory files: %w", err))
		}
		for _, f := range freed {
			rep.add("memory file %s", f)
		}
	}
	return rep, errors.Join(errs...)
}
