//go:build linux && !amd64

package rehome

import (
	"fmt"
	"os"
	"runtime"

	"github.com/containerd/errdefs"
	"golang.org/x/sys/unix"
)

func supported() error {
	return fmt.Errorf("rehome: system call injection on %s/%s: %w", runtime.GOOS, runtime.GOARCH, errdefs.ErrNotImplemented)
}

type proc struct{}

func (t *Tracee) seize(pids []int) error { return supported() }
func (t *Tracee) detach() error          { return supported() }

// Remap is not implemented on this architecture.
func (t *Tracee) Remap(pid int, path string, vmas []VMA) ([]VMA, error) { return nil, supported() }

// InstallFilter is not implemented on this architecture.
func (t *Tracee) InstallFilter(pid int, prog []unix.SockFilter) error { return supported() }

// CopyPages is not implemented on this architecture.
func (t *Tracee) CopyPages(pid int, path string, vmas []VMA) (CopyStats, error) {
	return CopyStats{}, supported()
}

// DefaultChunk is Move's default chunk size.
const DefaultChunk = 64 << 20

// Move is not implemented on this architecture.
func (t *Tracee) Move(pid int, path string, vmas []VMA, chunk uint64) ([]VMA, CopyStats, error) {
	return nil, CopyStats{}, supported()
}

func (t *Tracee) MoveFile(pid int, host *os.File, path string, vmas []VMA, chunk uint64) ([]VMA, CopyStats, error) {
	return nil, CopyStats{}, supported()
}

// Filters is not implemented on this architecture.
func (t *Tracee) Filters(pid int) ([][][]byte, error) { return nil, supported() }

// Userfaultfd: linux/amd64 only.
func (t *Tracee) Userfaultfd(pid int) (*os.File, error) { return nil, supported() }
