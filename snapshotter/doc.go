// Package snapshotter is LazyFork's overlay snapshotter: containerd's snapshot
// API over overlayfs, plus frozen layers for forks.
//
// # Layout
//
// Everything lives under one root directory:
//
//	root/metadata.db        bbolt, through containerd's core/snapshots/storage
//	root/snapshots/<id>/fs   a snapshot's layer (the upper dir while active)
//	root/snapshots/<id>/work overlay's work dir (active snapshots only)
//	root/snapshots/new-*     directories being built; renamed to <id> inside
//	                         the metadata transaction that records them
//
// A directory is removed only after the transaction that forgot it has
// committed, and Cleanup (also run on start) removes every directory the
// metadata does not know, so a crash at any point leaves either a record with
// its directory or a leftover directory that the next start removes.
//
// A directory being built is never an orphan: its new-* name is reserved in
// memory before its mkdir and released only once it is renamed or removed,
// and the sweeps (Cleanup, and Remove's unless removals are deferred) skip
// reserved names. A freeze fills its directory outside any transaction while
// other calls, removals included, carry on. A crashed process's reservations
// died with it, so the start-up Cleanup removes its new-* leftovers.
//
// # Frozen layers
//
// A fork must see its parent's filesystem as it was at the fork instant while
// the parent keeps writing to its own upper dir. A frozen layer is a committed
// snapshot whose content is a copy of an active snapshot's upper dir as it was
// while the task using it was frozen, and whose parent is the active
// snapshot's parent. Forks are then prepared on the frozen layer with fresh,
// empty upper dirs, so each fork costs one mkdir no matter how much the parent
// wrote, and a fork of a fork stacks one more frozen layer.
//
// It is created through the ordinary snapshot API, so that containerd's
// metadata (and therefore its garbage collector and leases) tracks it:
//
//	Prepare(tmp, parentOf(active), label FreezeSourceLabel=active)  task running
//	Commit(frozen, tmp)                                             task frozen
//
// Seeing the label, Prepare copies the source's upper dir while the task still
// runs (reflinks where the filesystem has them, copy_file_range otherwise,
// holes kept), and Commit walks it again and copies only the files whose ctime
// moved since, so the task is frozen for what changed, not for what it holds
// (see freeze.go). Package snapshotter/client wraps the calls.
//
// A frozen layer lives exactly as long as anything stacks on it: containerd's
// GC follows parent links, and this snapshotter refuses to remove a snapshot
// that still has children.
package snapshotter
