package client

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	containerd "github.com/containerd/containerd/v2/client"
	"github.com/containerd/containerd/v2/core/leases"
	"github.com/containerd/containerd/v2/core/snapshots"
	"github.com/containerd/containerd/v2/pkg/namespaces"
	"github.com/containerd/errdefs"
	"github.com/containerd/log"

	"github.com/lazyfork/lazyfork/api"
	"github.com/lazyfork/lazyfork/internal/procfs"
	"github.com/lazyfork/lazyfork/memfile"
)

// Report lists what Reconcile or GC removed (or, dry, would remove), one
// line per object: "thawed NS/ID", "fork NS/ID", "frozen layer NAME",
// "rootfs snapshot NAME", "snapshot dir DIR", "lease NS/ID", "op record ID",
// "lock FILE".
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
	ents, err := os.ReadDir(c.opsDir())
	if errors.Is(err, os.ErrNotExist) {
		return rep, nil
	}
	if err != nil {
		return rep, err
	}
	var errs []error
	for _, e := range ents {
		if !strings.HasSuffix(e.Name(), ".json") || strings.HasPrefix(e.Name(), ".") {
			continue
		}
		p := filepath.Join(c.opsDir(), e.Name())
		rec, err := readOp(p)
		if err != nil {
			if errors.Is(err, os.ErrNotExist) {
				continue
			}
			// A torn record cannot exist (written atomically): not ours.
			errs = append(errs, err)
			continue
		}
		if rec.alive() {
			continue
		}
		r, err := c.undo(ctx, rec, dry)
		rep.Removed = append(rep.Removed, r.Removed...)
		if err != nil {
			errs = append(errs, fmt.Errorf("interrupted fork of %s/%s (record %s): %w", rec.Namespace, rec.Parent, p, err))
			continue
		}
		rep.add("op record %s", rec.ID)
		if !dry {
			if err := os.Remove(p); err != nil && !errors.Is(err, os.ErrNotExist) {
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
	if rec.SnapshotDir != "" && filepath.Dir(rec.SnapshotDir) == c.snapshotsDir() {
		if _, err := os.Stat(rec.SnapshotDir); err == nil {
			if !dry {
				var family string
				if info, err := memfile.ReadSnapshot(api.ImageDir(rec.SnapshotDir)); err == nil {
					family = info.Family
				}
				if err := c.removeSnapshot(family, rec.SnapshotDir); err != nil {
					errs = append(errs, fmt.Errorf("remove snapshot dir %s: %w", rec.SnapshotDir, err))
				} else {
					rep.add("snapshot dir %s", rec.SnapshotDir)
				}
			} else {
				rep.add("snapshot dir %s", rec.SnapshotDir)
			}
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
	unlock, ok, err := c.tryLockParent(rec.Namespace, rec.Parent)
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

// GC is Reconcile, then a sweep for orphans no record names: snapshot
// directories a Fork made (they hold its op marker) that no live operation
// and no container label (api.LabelSnapshot, api.LabelStopped, in any namespace)
// references and that are older than OrphanAge, leases labelled api.LabelOp
// whose operation is over, and parent locks of containers that are gone. dry
// reports without removing.
func (c *Client) GC(ctx context.Context, dry bool) (Report, error) {
	rep, err := c.reconcile(ctx, dry)
	errs := []error{err}
	live := map[string]bool{} // operations still running
	if ents, err := os.ReadDir(c.opsDir()); err == nil {
		for _, e := range ents {
			if rec, err := readOp(filepath.Join(c.opsDir(), e.Name())); err == nil && rec.alive() {
				live[rec.ID] = true
			}
		}
	}
	nss, err := c.cd.NamespaceService().List(ctx)
	if err != nil {
		return rep, errors.Join(append(errs, fmt.Errorf("list namespaces: %w", err))...)
	}
	used := map[string]bool{}  // snapshot dirs containers reference
	locks := map[string]bool{} // lock files of containers that exist
	for _, ns := range nss {
		nctx := namespaces.WithNamespace(ctx, ns)
		ctrs, err := c.cd.ContainerService().List(nctx)
		if err != nil {
			return rep, errors.Join(append(errs, fmt.Errorf("list containers of %s: %w", ns, err))...)
		}
		for _, x := range ctrs {
			locks[c.lockPath(ns, x.ID)] = true
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
			if op == "" || live[op] {
				continue
			}
			if _, err := os.Stat(c.opPath(op)); err == nil {
				continue // its record is being reconciled
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
	// Parent locks of containers that are gone (ctr or nerdctl removed
	// them), unless a fork holds them right now.
	lockFiles, _ := filepath.Glob(filepath.Join(c.locksDir(), "*.lock"))
	for _, p := range lockFiles {
		if locks[p] {
			continue
		}
		if dry || removeLockFile(p) {
			rep.add("lock %s", filepath.Base(p))
		}
	}
	dirs, _ := os.ReadDir(c.snapshotsDir())
	for _, d := range dirs {
		dir := filepath.Join(c.snapshotsDir(), d.Name())
		b, err := os.ReadFile(filepath.Join(dir, opMarker))
		if err != nil {
			continue // not a Fork's, or kept: owned elsewhere
		}
		op := strings.TrimSpace(string(b))
		if live[op] || used[dir] {
			continue
		}
		if _, err := os.Stat(c.opPath(op)); err == nil {
			continue
		}
		if st, err := os.Stat(dir); err != nil || time.Since(st.ModTime()) < OrphanAge {
			continue
		}
		if !dry {
			var family string
			if info, err := memfile.ReadSnapshot(api.ImageDir(dir)); err == nil {
				family = info.Family
			}
			if rfs, err := readRootfsSource(dir); err == nil && rfs.Frozen != "" {
				fctx := ctx
				if rfs.Namespace != "" {
					fctx = namespaces.WithNamespace(ctx, rfs.Namespace)
				}
				if err := c.cd.SnapshotService(rfs.Snapshotter).Remove(fctx, rfs.Frozen); err == nil {
					rep.add("frozen layer %s", rfs.Frozen)
				}
			}
			if err := c.removeSnapshot(family, dir); err != nil {
				errs = append(errs, err)
				continue
			}
		}
		rep.add("snapshot dir %s", dir)
	}
	return rep, errors.Join(errs...)
}

// saveRestoreLog copies fork id's CRIU restore log out of its task bundle
// (which its removal deletes) into ROOT/logs and returns the copy's path, ""
// if it is not found. The bundle is found beside the bundle a LazyFork shim
// of the namespace runs in (its working directory).
func (c *Client) saveRestoreLog(ctx context.Context, id string) string {
	ns, _ := namespaces.Namespace(ctx)
	for _, p := range procfs.Find(func(args []string) bool {
		return strings.HasPrefix(filepath.Base(args[0]), "containerd-shim-lazyfork")
	}) {
		cwd, err := os.Readlink("/proc/" + strconv.Itoa(p.PID) + "/cwd")
		if err != nil || filepath.Base(filepath.Dir(cwd)) != ns {
			continue
		}
		src := filepath.Join(filepath.Dir(cwd), id, "work", "restore.log")
		in, err := os.Open(src)
		if err != nil {
			continue
		}
		defer in.Close()
		dst := filepath.Join(api.Root(c.root).Logs(), ns+"-"+id+"-restore.log")
		if err := os.MkdirAll(filepath.Dir(dst), 0o700); err != nil {
			return src
		}
		out, err := os.Create(dst)
		if err != nil {
			return src
		}
		defer out.Close()
		if _, err := io.Copy(out, in); err != nil {
			log.G(ctx).WithError(err).Warn("lazyfork: copy restore log")
			return src
		}
		return dst
	}
	return ""
}
