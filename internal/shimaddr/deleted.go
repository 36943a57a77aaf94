//go:build linux

package shimaddr

import (
	"io"
	"os"
	"path/filepath"
	"syscall"

	"github.com/lazyfork/lazyfork/internal/atomicfile"
)

// DeletedFile, in a task's bundle, holds the task's DeleteResponse (protobuf,
// as the shim binary's `delete` command prints it), written by the full shim
// once its Delete RPC has deleted the task in runc (its state gone, its
// rootfs unmounted) and released all LazyFork held for it.
//
// containerd runs the shim binary's `delete` in the bundle after every task
// delete, as the task's connection closes (cleanupAfterDeadShim), and waits
// for it. For a task deleted that way the full shim's `delete` would start a
// Go binary and run `runc delete --force` only to find nothing left, and
// containerd ignores its answer (the delete's own result stands). The front
// answers from this file instead. A task not deleted through the RPC (a shim
// that died) has no such file: the full shim cleans up.
const DeletedFile = "lazyfork-deleted"

// maxDeleted bounds the file: a DeleteResponse is a few dozen bytes.
const maxDeleted = 4096

// WriteDeleted records the deleted task's DeleteResponse in its bundle.
func WriteDeleted(bundle string, response []byte) error {
	return atomicfile.WriteVolatile(filepath.Join(bundle, DeletedFile), response, 0o600)
}

// ReadDeleted returns the DeleteResponse recorded in bundle, and whether
// there is one to trust: a regular file of this user with one link, no
// larger than a DeleteResponse can be, and not older than the bundle's spec
// (a bundle made again for a new task with the same id has a newer spec).
func ReadDeleted(bundle string) ([]byte, bool) {
	// O_NONBLOCK: a fifo there must not hang the delete.
	f, err := os.OpenFile(filepath.Join(bundle, DeletedFile), os.O_RDONLY|syscall.O_NOFOLLOW|syscall.O_NONBLOCK, 0)
	if err != nil {
		return nil, false
	}
	defer f.Close()
	var st, spec syscall.Stat_t
	if syscall.Fstat(int(f.Fd()), &st) != nil || st.Mode&syscall.S_IFMT != syscall.S_IFREG ||
		st.Uid != uint32(os.Geteuid()) || st.Nlink != 1 || st.Size > maxDeleted {
		return nil, false
	}
	if syscall.Stat(filepath.Join(bundle, SpecFile), &spec) != nil || spec.Mtim.Nano() > st.Mtim.Nano() {
		return nil, false
	}
	b, err := io.ReadAll(io.LimitReader(f, maxDeleted+1))
	if err != nil || len(b) > maxDeleted {
		return nil, false
	}
	return b, true
}
