// Package atomicfile replaces files so that a reader, or a process started
// after a crash, sees either the old content or the new, never a torn write:
// the data goes to a temporary file beside the target, is synced, and is
// renamed over it.
package atomicfile

import (
	"fmt"
	"io"
	"os"
	"path/filepath"
)

// Write replaces path with what write produces, with permissions mode.
func Write(path string, mode os.FileMode, write func(io.Writer) error) error {
	return replace(path, mode, write, true)
}

// WriteFile replaces path with data, with permissions mode.
func WriteFile(path string, data []byte, mode os.FileMode) error {
	return replace(path, mode, writeAll(data), true)
}

// WriteVolatile replaces path with data, with permissions mode, by a rename
// but without a sync: for runtime state that means nothing after a reboot
// (containerd's bundles, a tmpfs), where a sync protects nothing and costs a
// disk flush on a host whose /run is a disk.
func WriteVolatile(path string, data []byte, mode os.FileMode) error {
	return replace(path, mode, writeAll(data), false)
}

func writeAll(data []byte) func(io.Writer) error {
	return func(w io.Writer) error {
		_, err := w.Write(data)
		return err
	}
}

func replace(path string, mode os.FileMode, write func(io.Writer) error, sync bool) error {
	f, err := os.CreateTemp(filepath.Dir(path), "."+filepath.Base(path)+".tmp-*")
	if err != nil {
		return err
	}
	tmp := f.Name()
	defer os.Remove(tmp) // no-op after the rename
	if err := write(f); err != nil {
		f.Close()
		return fmt.Errorf("write %s: %w", path, err)
	}
	if err := f.Chmod(mode); err != nil {
		f.Close()
		return err
	}
	if sync {
		if err := f.Sync(); err != nil {
			f.Close()
			return err
		}
	}
	if err := f.Close(); err != nil {
		return err
	}
	return os.Rename(tmp, path)
}
