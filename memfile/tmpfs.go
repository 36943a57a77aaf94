package memfile

import (
	"fmt"
	"os"

	"golang.org/x/sys/unix"
)

// IsTmpfs reports whether dir is on a tmpfs.
func IsTmpfs(dir string) (bool, error) {
	var st unix.Statfs_t
	if err := unix.Statfs(dir, &st); err != nil {
		return false, err
	}
	return st.Type == unix.TMPFS_MAGIC, nil
}

// EnsureTmpfs mounts a tmpfs at dir (created if missing) unless dir already is
// on one. sizeBytes limits the tmpfs (0: the kernel's default, half of RAM).
// /run is not a tmpfs on every host: LazyFork mounts its own.
func EnsureTmpfs(dir string, sizeBytes int64) error {
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return fmt.Errorf("ensure tmpfs: %w", err)
	}
	ok, err := IsTmpfs(dir)
	if err != nil {
		return fmt.Errorf("ensure tmpfs: %w", err)
	}
	if ok {
		return nil
	}
	data := "mode=0755"
	if sizeBytes > 0 {
		data += fmt.Sprintf(",size=%d", sizeBytes)
	}
	if err := unix.Mount("lazyfork", dir, "tmpfs", unix.MS_NOSUID|unix.MS_NODEV, data); err != nil {
		return fmt.Errorf("mount tmpfs at %s: %w", dir, err)
	}
	return nil
}
