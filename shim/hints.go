package shim

import (
	"fmt"
	"strings"

	"github.com/containerd/errdefs/pkg/errgrpc"
)

// What a user can do with a LazyFork snapshot that a standard flow cannot
// use (issue 15, item 10): the memory of a snapshot lives in memory files on
// the host (and LazyFork root) that took it, and its restores need the
// lazyfork runtime; `lazyfork export` writes a standard checkpoint archive
// (memory inlined) that runc, CRIU, CRI and checkpointctl take, and
// `lazyfork import` brings one back as a forkable container.

// hintFilesGone is added to the errors of a restore whose snapshot's memory
// files are not here.
const hintFilesGone = "this is a LazyFork snapshot, whose memory lives in memory files on the host that took it: " +
	"restore it there with the lazyfork runtime, or `lazyfork export` it there (a standard checkpoint archive) and `lazyfork import` the archive here"

// hintCgroupBusy is added when runc refuses to restore a snapshot into a
// cgroup that holds processes (ctr c restore of a checkpoint of a running
// container reuses its cgroups path).
const hintCgroupBusy = "this is a LazyFork snapshot of a container that still runs in that cgroup: a restore needs a cgroup of its own; " +
	"make copies with `lazyfork fork` (each gets its own cgroup), restore it with the lazyfork runtime under another cgroups path, or `lazyfork export` it for runc"

// withSnapshotHint adds what to do instead to a failed restore of a LazyFork
// snapshot, where runc's error alone does not say it.
func withSnapshotHint(err error) error {
	if err == nil || !strings.Contains(err.Error(), "cgroup is not empty") {
		return err
	}
	return errgrpc.ToGRPC(fmt.Errorf("%w (%s)", errgrpc.ToNative(err), hintCgroupBusy))
}
