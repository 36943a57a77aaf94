package api

import (
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"time"

	"github.com/containerd/errdefs"
)

// Files of a snapshot directory (ROOT/snapshots/<id>/, or any directory a
// client keeps) and of its image directory.
const (
	// ImageDirName is the image directory inside a snapshot directory: the
	// CRIU dump, rewritten, with SnapshotFile and SourceFile.
	ImageDirName = "image"
	// RootfsFile, in a snapshot directory, is its RootfsRecord.
	RootfsFile = "rootfs.json"
	// SnapshotFile, in an image directory, is its SnapshotInfo: what makes a
	// CRIU image a LazyFork snapshot.
	SnapshotFile = "lazyfork.json"
	// SourceFile, in an image directory, is its SnapshotSource. It is
	// written into the staged image, so a snapshot has it from the moment
	// it exists, and it travels inside a CRI checkpoint archive.
	SourceFile = "lazyfork-source.json"
	// BundleStateFile, in a container's bundle, is the shim's state of the
	// container (for the shim's delete subcommand and later shims).
	BundleStateFile = "lazyfork-state.json"
)

// ImageDir is the image directory of the snapshot directory snapDir.
func ImageDir(snapDir string) string { return filepath.Join(snapDir, ImageDirName) }

// SnapshotInfo describes a rewritten image (imageDir/SnapshotFile); the
// memfile rewrite writes it.
type SnapshotInfo struct {
	Family string `json:"family"`
	// Files are the family files (base names) the image maps: what it pins.
	Files []string `json:"files"`
	// Parent is the family file whose contents this snapshot's delta pages
	// sit on top of ("" for a snapshot that owns all its memory: a first
	// rewrite, or a rebase).
	Parent string `json:"parent,omitempty"`
	// Pages is the number of pages the image maps from family files.
	Pages uint64 `json:"pages"`
	// KeptPages is the number of pages left in the image (restored by CRIU
	// into each copy's private memory).
	KeptPages uint64 `json:"kept_pages"`
	// MapDir is the directory recorded in the image for the files.
	MapDir  string    `json:"map_dir"`
	Rebased bool      `json:"rebased,omitempty"`
	Created time.Time `json:"created"`
	// Patches are the pieces of the image's patched VMAs that map files
	// other than their base (a parent's writes since its last move).
	Patches []Patch `json:"patches,omitempty"`
}

// Patch is a range of process Pid's memory (as numbered in the image) that
// a snapshot maps from family file File at Offset.
type Patch struct {
	Pid    uint32 `json:"pid"`
	Start  uint64 `json:"start"`
	End    uint64 `json:"end"`
	File   string `json:"file"`
	Offset int64  `json:"offset"`
}

// SnapshotSource is who a snapshot was taken of, and when
// (imageDir/SourceFile); the shim writes it at each checkpoint.
type SnapshotSource struct {
	// Namespace is the containerd namespace of the container.
	Namespace string `json:"namespace"`
	// Container is its id.
	Container string `json:"container"`
	// Family is its family.
	Family string `json:"family"`
	// PodNamespace is its pod's Kubernetes namespace ("" outside CRI).
	PodNamespace string `json:"podNamespace,omitempty"`
	// Forkable is its lazyfork.io/forkable opt-in: pods may fork it.
	Forkable bool `json:"forkable,omitempty"`
	// Taken is when the rewrite began.
	Taken time.Time `json:"taken"`
	// Thawed is when the shim thawed the paused container right after its
	// dump, before the rewrite, as the checkpoint's options asked
	// (CheckpointOptions.ThawAfterDump); zero if it did not.
	Thawed time.Time `json:"thawed,omitzero"`
	// Paused is how long the container was frozen, from when the shim's
	// Pause began freezing it to Thawed, on the shim's monotonic clock; zero
	// if it was paused otherwise or not thawed. A Pause may first copy a
	// fragmented heap while the container runs (consolidation): the pause
	// the container felt is this, not the time since the caller's Pause.
	// It includes the brief freeze of a precopy this snapshot's move took
	// (a first snapshot's, before the Pause: the container was frozen
	// twice, and this is the sum).
	Paused time.Duration `json:"pausedNs,omitempty"`
}

// RootfsRecord is where a snapshot's forks get the parent's writable layer
// (snapDir/RootfsFile); the client writes it.
type RootfsRecord struct {
	// Frozen is a frozen layer in LazyFork's snapshotter; forks stack a
	// fresh upper on it (O(1) per fork).
	Frozen string `json:"frozen,omitempty"`
	// UpperCopy is a copy of the parent's upper directory (any overlay-style
	// snapshotter), copied again into each fork.
	UpperCopy string `json:"upperCopy,omitempty"`
	// Snapshotter and Namespace locate Frozen for a fork whose rootfs is
	// made elsewhere (a pod's).
	Snapshotter string `json:"snapshotter,omitempty"`
	Namespace   string `json:"namespace,omitempty"`
}

// FamilyRecord is what the shim reports about a family for the tools
// (Root.FamilyRecord): which memory cgroup its rewritten memory files are
// charged to. The kernel charges a tmpfs page to the memory cgroup of the
// process that first wrote it, and the rewrite runs in the family's shim; so
// those files belong to the shim's memory cgroup (containerd's, or runc's
// ShimCgroup option), never to the forks.
type FamilyRecord struct {
	Family       string    `json:"family"`
	MemoryCgroup string    `json:"memoryCgroup"`
	ShimPID      int       `json:"shimPid"`
	Updated      time.Time `json:"updated"`
}

// ReadSnapshotSource reads imageDir/SourceFile. An image without one gives an
// error wrapping errdefs.ErrNotFound; one that does not decode,
// errdefs.ErrDataLoss.
func ReadSnapshotSource(imageDir string) (*SnapshotSource, error) {
	p := filepath.Join(imageDir, SourceFile)
	b, err := os.ReadFile(p)
	if errors.Is(err, os.ErrNotExist) {
		return nil, fmt.Errorf("snapshot %s records no source container: %w", imageDir, errdefs.ErrNotFound)
	}
	if err != nil {
		return nil, err
	}
	var src SnapshotSource
	if err := json.Unmarshal(b, &src); err != nil {
		return nil, fmt.Errorf("%s: %v: %w", p, err, errdefs.ErrDataLoss)
	}
	return &src, nil
}

// OpRecord is the intent journal of one fork call (Root.Ops()/<ID>.json):
// what it may have made, so that whoever finds it after the call died
// (the client's Reconcile) can undo it. It is written before the parent is
// paused and updated as resources appear; it goes when the call has ended,
// cleanly. The call is alive while it holds its lock "op:<ID>"; records of
// older clients name their process instead (PID, PIDStart).
type OpRecord struct {
	ID        string `json:"id"`
	Namespace string `json:"namespace"`
	Parent    string `json:"parent"`
	// PID and PIDStart (field 22 of /proc/PID/stat) identify the process
	// of a call made by an older client; a reused PID has another start
	// time. Zero in records that rely on the op lock.
	PID      int    `json:"pid,omitempty"`
	PIDStart string `json:"pidStart,omitempty"`
	// Paused: this call paused (or was about to pause) the parent; a dead
	// call's parent is thawed if it is still paused.
	Paused bool `json:"paused,omitempty"`
	// SnapshotDir is ROOT/snapshots/<x>, the snapshot's directory.
	SnapshotDir string `json:"snapshotDir,omitempty"`
	// ImageDir is the image directory the forks restore from (their
	// LabelSnapshot): in SnapshotDir, or a kept snapshot's.
	ImageDir string `json:"imageDir,omitempty"`
	// Snapshotter holds the parent's rootfs, Frozen the frozen layer of its
	// writable layer, and the forks' rootfs snapshots (named as the forks).
	Snapshotter string `json:"snapshotter,omitempty"`
	Frozen      string `json:"frozen,omitempty"`
	// Lease is the containerd lease the call's resources are made under.
	Lease   string    `json:"lease,omitempty"`
	Forks   []string  `json:"forks,omitempty"`
	Created time.Time `json:"created"`
}
