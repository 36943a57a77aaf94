// Package snapshotter is LazyFork's snapshotter: containerd's overlay
// snapshotter (github.com/containerd/containerd/v2/plugins/snapshots/overlay,
// the version in go.mod) plus frozen layers for forks.
//
// Every snapshot call goes to the overlay snapshotter except a freeze's
// Prepare and Commit (FreezeSourceLabel), which wrap it; both run on one
// bbolt metadata store, passed with overlay.WithMetaStore, through which a
// freeze reads records and checks its preconditions inside the overlay's own
// write transactions (withTxCheck). Around the overlay snapshotter LazyFork
// adds a flock on the root (a second process fails fast instead of waiting
// on bbolt), a reconcile on start, and Status.
//
// # Layout
//
// The overlay snapshotter's, under one root directory:
//
//	root/metadata.db             bbolt, through containerd's core/snapshots/storage
//	root/snapshots/<id>/fs       a snapshot's layer (the upper dir while active)
//	root/snapshots/<id>/work     overlay's work dir (active snapshots only)
//	root/snapshots/new-*         directories being built, inside the overlay's
//	                             transaction that records them
//	root/snapshots/<id>/fs.pre   a freeze's first-pass copy, renamed over fs
//	root/snapshots/<id>/fs.sync  a freeze's second pass, exchanged with fs
//
// A directory is removed only after the transaction that forgot it has
// committed, and Cleanup (also run on start) removes every directory the
// metadata does not know, so a crash at any point leaves either a record with
// its directory or a leftover directory that the next start removes. A
// freeze copies outside any transaction, while other calls, removals
// included, carry on, but only inside the directory of its own recorded
// snapshot, which no sweep touches; the start removes the fs.pre and fs.sync
// a crash left there, and the layer itself is always whole.
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
