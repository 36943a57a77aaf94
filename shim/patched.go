package shim

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"

	"github.com/containerd/errdefs"

	"github.com/lazyfork/lazyfork/api"
	"github.com/lazyfork/lazyfork/internal/cgroupmem"
	"github.com/lazyfork/lazyfork/internal/procfs"
	"github.com/lazyfork/lazyfork/memfile"
	"github.com/lazyfork/lazyfork/memfile/rehome/movehelper"
)

// Patched deltas (Config.PatchDeltas): once a container has moved onto its
// family's files, its later snapshots leave it there. It keeps writing into
// its file mappings, as anonymous pages inside them (one mapping still, so
// its dumps cost what a dump of few mappings costs), and each dump holds
// every page it wrote since its last move. The rewrite turns those pages
// into patches of memory files for its forks (memfile.PatchOptions): a
// patch whose bytes the previous snapshot's patches hold maps that one
// again, the rest go into the new file. So a later snapshot writes about
// what the container wrote since the previous one, its forks hold none of it
// privately, and the pause has no move in it: with a move per snapshot, a
// container writing isolated pages all over its heap got one mapping per
// page, and its pause (the move's plan and mmaps, and CRIU's per-mapping
// work) grew with them past 200 ms.
//
// The container moves again to consolidate: once its forks' patches reach
// consolidateAfter, or the pages it holds twice (in its memory and in
// patches) reach consolidateBytes, its next Pause prepares a consolidation
// (Fragments with private: its mappings that hold written pages, copied
// from their files while it runs) and the next checkpoint moves it onto
// that copy, its written pages on top: one mapping, nothing held twice.
// Where no consolidation can be prepared (cgroup v2), it moves plainly
// (patches in the container itself) at twice those bounds. And a container
// whose writes come in runs (few patches) moves plainly once it holds
// movePlainBytes twice: its move maps a few patches (as cheap in its pause
// as a patched snapshot, measured), frees what it held twice, and keeps its
// and its forks' mappings few.
const (
	consolidateBytes = 32 << 20
	movePlainBytes   = 2 << 20
)

// patchesDeltas reports whether a container's later snapshots are patched
// deltas: the shim setting, unless its lazyfork.io/rehome annotation asks
// for a move at each snapshot.
func (s *Service) patchesDeltas(st *containerState) bool {
	return s.cfg.PatchDeltas && st.Rehome != api.RehomeEachSnapshot
}

// patchedNext returns what the next snapshot of a container that moved
// needs for patched deltas: the previous snapshot's patches, and whether a
// move is due instead (a consolidation was prepared, or the bounds passed
// twice over without one).
func patchedNext(key string) (prev []memfile.Patch, moveDue bool) {
	if peekPrepared(key) != nil {
		return nil, true
	}
	consolidation.Lock()
	defer consolidation.Unlock()
	n := moveNotes[key]
	if n == nil || !n.patched {
		return nil, false
	}
	return n.prev, n.plainMoveDue()
}

// plainMoveDue: a patched container's next snapshot moves it, without a
// consolidation (see above).
func (n *moveNote) plainMoveDue() bool {
	return n.patches < consolidateAbove && n.private >= movePlainBytes ||
		n.patches >= 2*consolidateAfter || n.private >= 2*consolidateBytes
}

// notePatched records a patched snapshot of a container: its patches for
// the next one, and what the bounds of consolidation count.
func notePatched(key string, pid int, res *memfile.Result) {
	consolidation.Lock()
	defer consolidation.Unlock()
	n := moveNotes[key]
	if n == nil {
		n = &moveNote{}
		moveNotes[key] = n
	}
	n.pid, n.patched, n.moved = pid, true, true
	n.prev = res.Patches
	n.patches = len(res.Patches)
	n.private = int64(res.PagesPrivate) * 4096
}

// The container holds its last patched snapshot's patch files itself
// (patchesHolder), so that its next snapshot can map them again even when
// that snapshot and its forks are gone by then (a caller that forks, uses
// and drops each fork): without it, each snapshot would write every page
// written since the last move again. They are what it wrote since then, a
// second copy bounded by the consolidation's bounds; a move (it no longer
// needs them) and the container's release drop the reference.

// patchesHolder is the reference a container holds on the patch files of its
// last patched snapshot, whose new file was file.
func patchesHolder(ns, id, file string) string { return "patches:" + ns + "/" + id + "/" + file }

// holdPatches makes the container hold the files of a patched snapshot's
// patches, and no others.
func holdPatches(store *memfile.Store, st *containerState, res *memfile.Result) error {
	var files []string
	for _, p := range res.Patches {
		if !slices.Contains(files, p.File) {
			files = append(files, p.File)
		}
	}
	keep := ""
	if len(files) > 0 {
		keep = patchesHolder(st.Namespace, st.ID, slices.Max(files))
		if err := store.Ref(st.Family, keep, files); err != nil {
			return err
		}
	}
	return dropPatchHolders(store, st, keep)
}

// dropPatchHolders drops the container's references on patch files, except
// holder keep.
func dropPatchHolders(store *memfile.Store, st *containerState, keep string) error {
	holders, err := store.Holders(st.Family)
	if err != nil {
		return err
	}
	var errs []error
	for h := range holders {
		if h != keep && strings.HasPrefix(h, patchesHolder(st.Namespace, st.ID, "")) {
			if err := store.Unref(st.Family, h); err != nil && !errdefs.IsNotFound(err) {
				errs = append(errs, err)
			}
		}
	}
	return errors.Join(errs...)
}

// copyPatchesCharged returns the PatchOptions.Copy of a container's patched
// snapshot: its patches are written by a helper in its memory cgroup, as a
// move's file is, so that they are charged to it and its limit bounds them;
// chargedTo gets that cgroup. Patches that would leave it less than half its
// headroom fail the snapshot (it keeps running; its limit is clear in the
// error). On cgroup v2 (its memory cgroup is the one a helper would have to
// join beside its processes) the rewrite copies them itself, charged to the
// shim.
func (s *Service) copyPatchesCharged(pid int, chargedTo *string) func(context.Context, string, []memfile.CopyRange) error {
	return func(ctx context.Context, dst string, copies []memfile.CopyRange) error {
		freezer, err := freezerCgroup(pid)
		if err != nil {
			return fmt.Errorf("%v: %w", err, errdefs.ErrNotImplemented)
		}
		if mem, err := memoryCgroupDir(pid); err != nil || mem == freezer {
			return fmt.Errorf("cgroup v2: %w", errdefs.ErrNotImplemented)
		}
		var bytes int64
		req := movehelper.Request{HostFile: dst}
		for _, c := range copies {
			bytes += c.Len
			req.Copies = append(req.Copies, movehelper.CopyRange{Src: c.Src, SrcOff: c.SrcOff, DstOff: c.DstOff, Len: c.Len})
		}
		if path, _, err := procfs.Cgroup(pid, "memory"); err == nil {
			if limit, usage, ok, err := cgroupmem.Limit(path); err == nil && ok && bytes > (limit-usage)/2 {
				return fmt.Errorf("the container's %d KiB of patches (what it wrote since its last move) need more than half of its %d KiB of headroom under its memory limit of %d MiB: raise the limit, or set %s=%s: %w",
					bytes>>10, max(limit-usage, 0)>>10, limit>>20, api.AnnotationRehome, api.RehomeEachSnapshot, errdefs.ErrResourceExhausted)
			}
		}
		var run helperRun
		reply, err := s.runRehomeHelper(ctx, pid, &req, nil, nil, &run)
		if err == nil && reply.Err != "" {
			err = errors.New(reply.Err)
		}
		if err != nil {
			return err
		}
		*chargedTo = req.ChargedTo
		return nil
	}
}
