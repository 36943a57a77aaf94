package node

import (
	"context"
	"io"
	"time"

	"github.com/lazyfork/lazyfork/api"
)

// Node is what a client needs of LazyFork's root directory on the node.
// Paths are the node's; a client passes them to containerd as strings.
type Node interface {
	// PrepareSnapshot makes ROOT/snapshots/<op>/ (with operation op's
	// marker) and its empty image directory.
	PrepareSnapshot(ctx context.Context, op string) (snapDir, imageDir string, err error)
	// KeepSnapshot drops the snapshot's operation marker: it outlives its
	// operation.
	KeepSnapshot(ctx context.Context, snapDir string) error
	// RemoveSnapshot drops the snapshot's memory-file reference and
	// removes its directory (under ROOT/snapshots only).
	RemoveSnapshot(ctx context.Context, snapDir string) error
	// SetRootfs writes the snapshot's rootfs record.
	SetRootfs(ctx context.Context, snapDir string, r *api.RootfsRecord) error
	// ReleaseRootfs removes the snapshot's layer copy and rootfs record.
	ReleaseRootfs(ctx context.Context, snapDir string) error
	// Snapshot reads a snapshot by its image directory; one that is not a
	// LazyFork snapshot (no api.SnapshotFile) is errdefs.ErrNotFound.
	Snapshot(ctx context.Context, imageDir string) (*Snapshot, error)
	// SnapshotDirs lists ROOT/snapshots.
	SnapshotDirs(ctx context.Context) ([]SnapshotDir, error)

	// Families reports every family of the memory store, by name.
	Families(ctx context.Context) ([]Family, error)
	// FreeSpace is the room the node has for snapshots and forks.
	FreeSpace(ctx context.Context) (Space, error)
	// CollectMemory runs the memory store's GC (memfile.Store.GC): it drops
	// dead references (a container's whose task bundle is gone, with its
	// view) and frees the files nothing pins; it returns those files.
	CollectMemory(ctx context.Context) ([]string, error)

	// SaveOp writes an operation's record; RemoveOp removes it.
	SaveOp(ctx context.Context, rec *api.OpRecord) error
	RemoveOp(ctx context.Context, id string) error
	// Ops lists the operations' records; records it could not read are
	// in the error, the others are returned anyway.
	Ops(ctx context.Context) ([]OpState, error)
	// Lock takes lock key (ParentLock, OpLock), waiting for it if wait
	// (until ctx ends), else ok is false when another holds it. unlock
	// releases it; so does the holder's death.
	Lock(ctx context.Context, key string, wait bool) (unlock func(), ok bool, err error)
	// RemoveLock removes lock key's file unless it is held.
	RemoveLock(ctx context.Context, key string) (bool, error)
	// SweepLocks removes the lock files that are neither named by keep
	// nor held (only reports them if dry) and returns their names.
	SweepLocks(ctx context.Context, keep []string, dry bool) ([]string, error)

	// SaveRestoreLog copies fork id's CRIU restore log out of its task
	// bundle into ROOT/logs; "" if it is not found.
	SaveRestoreLog(ctx context.Context, ns, id string) (string, error)
	// PrepareLog makes the directory of log file path; RemoveLog removes
	// the file.
	PrepareLog(ctx context.Context, path string) error
	RemoveLog(ctx context.Context, path string) error
	// LogFiles lists the regular files of dir (none if it is missing).
	LogFiles(ctx context.Context, dir string) ([]string, error)
	// StatLog tells whether path exists and is a fifo.
	StatLog(ctx context.Context, path string) (exists, fifo bool, err error)
	// ReadLog reads log file path. With follow, a Read at its end waits for
	// more until Finish (then it reads to the end and returns io.EOF) or
	// ctx ends (io.EOF); a file not yet there is waited for as well.
	ReadLog(ctx context.Context, path string, follow bool) (LogReader, error)
	// Usage reports the memory of a container's init process pid (0:
	// none) and of its cgroup (its cgroups path).
	Usage(ctx context.Context, pid uint32, cgroup string) (Usage, error)

	// Close releases the node's resources (a Remote's connection).
	Close() error
}

// Snapshot is what a client reads of a snapshot.
type Snapshot struct {
	ImageDir string
	Family   string
	// Pages the image maps from family files.
	Pages uint64
	// Thawed is when the shim thawed the parent after its dump (zero if
	// it did not).
	Thawed time.Time
	// Paused is how long the shim kept the parent frozen for it, when it
	// froze and thawed it (zero otherwise), a precopy's freeze included.
	Paused time.Duration
	// Rootfs is nil if the snapshot has no rootfs record.
	Rootfs *api.RootfsRecord
	// Bytes of the snapshot directory's files.
	Bytes int64
	// SourceNamespace and SourceContainer say whose snapshot it is (its
	// api.SnapshotSource); empty if it has no source record.
	SourceNamespace, SourceContainer string
}

// SnapshotDir is one directory of ROOT/snapshots.
type SnapshotDir struct {
	Dir string
	// Op is the operation its marker names, "" if kept (or not a Fork's).
	Op      string
	ModTime time.Time
	Rootfs  *api.RootfsRecord
}

// Family describes a family's memory files on the node.
type Family struct {
	Name string
	// Files are the family's memory files and the bytes each occupies on the tmpfs.
	Files map[string]int64
	// Bytes is the total of Files: memory shared by every fork of the family.
	Bytes int64
	// Holders are the containers and snapshots that pin files, with the files.
	Holders map[string][]string
	// MemoryCgroup is the memory cgroup of the family's shim, which the
	// files its checkpoint rewrites wrote are charged to ("" if no
	// checkpoint was rewritten yet).
	MemoryCgroup string
	// ChargedTo is the memory cgroup each file is charged to, where it was
	// recorded: a rewrite's to its shim, a moved container's to the
	// container.
	ChargedTo map[string]string
}

// Space is the room the node has for snapshots and forks.
type Space struct {
	// Root and Free: the root and the bytes free on its filesystem.
	Root string
	Free uint64
	// MemAvailable is the node's MemAvailable (/proc/meminfo), 0 if
	// unknown.
	MemAvailable uint64
}

// OpState is an operation's record and whether the operation is alive.
type OpState struct {
	Record api.OpRecord
	Alive  bool
}

// Usage is the memory a container uses.
type Usage struct {
	// Memory is its cgroup's memory usage (0 if unknown).
	Memory int64
	// MemFileBytes and MemFileMappings: its init process's mappings of
	// memory files (address space, not resident pages).
	MemFileBytes    int64
	MemFileMappings int
	// RssAnon and RssShared: the process's RssAnon and RssShmem (pages of
	// the memory files).
	RssAnon, RssShared int64
}

// LogReader reads a log; see Node.ReadLog.
type LogReader interface {
	io.ReadCloser
	// Finish ends a follow at the end of the file.
	Finish()
}

// ParentLock is the lock of the snapshot phase of container id in ns.
func ParentLock(ns, id string) string { return "parent:" + ns + "/" + id }

// OpLock is the lock operation id holds while it runs.
func OpLock(id string) string { return "op:" + id }

// UnclaimedOp is what the marker of a snapshot made for a container that
// has yet to claim it names (a pod's fork-of archive the shim unpacks): an
// operation with no record, so never a live one; lazyfork gc gives it
// client.UnclaimedAge rather than its usual orphan age, as an unpack may be long.
const UnclaimedOp = "fork-of-unclaimed"
