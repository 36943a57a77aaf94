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

// withSocketOptHint says why a dump failed on a TCP or UDP socket's options:
// CRIU 4.1 asks every socket for SO_PASSCRED and SO_PASSSEC, which Linux 6.16
// and later answer only for unix and netlink sockets (EOPNOTSUPP), so it
// cannot dump a process holding an inet socket there; CRIU fixed it upstream
// after 4.1.1 (commit 4b7398595).
func withSocketOptHint(err error) error {
	if err == nil || !strings.Contains(err.Error(), "Can't get 1:34 opt") && !strings.Contains(err.Error(), "Can't get 1:16 opt") {
		return err
	}
	return errgrpc.ToGRPC(fmt.Errorf("%w (this CRIU cannot dump a process holding a TCP or UDP socket on Linux 6.16 or later: "+
		"it needs CRIU after 4.1.1, with upstream commit 4b7398595 \"criu/sockets: Restrict SO_PASSCRED and SO_PASSSEC to supported families\"; "+
		"until then, fork containers that hold no inet socket)", errgrpc.ToNative(err)))
}
