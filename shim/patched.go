package shim

import (
	"github.com/lazyfork/lazyfork/api"
	"github.com/lazyfork/lazyfork/memfile"
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
// (patches in the container itself) at twice those bounds.
const consolidateBytes = 64 << 20

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
	return n.prev, n.patches >= 2*consolidateAfter || n.private >= 2*consolidateBytes
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
	n.private = int64(res.PagesMoved) * 4096
}
