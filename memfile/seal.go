package memfile

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"

	"github.com/containerd/errdefs"
	"github.com/containerd/log"
	"golang.org/x/sys/unix"
)

// Inode flags of FS_IOC_GETFLAGS/FS_IOC_SETFLAGS (linux/fs.h); x/sys/unix
// has the ioctls but not the flags.
const (
	fsImmutableFL = 0x00000010 // FS_IMMUTABLE_FL: no write, truncate, unlink, link, rename, chmod
	fsAppendFL    = 0x00000020 // FS_APPEND_FL: blocks unlink too
)

// sealProbePrefix names the probe file of Store.sealing, in <root>/.state.
const sealProbePrefix = ".seal-probe-"

// Seal sets the immutable attribute of path (a regular file or directory):
// from then on nobody, root included, may write, truncate, unlink, link or
// rename it until the attribute is cleared (which needs
// CAP_LINUX_IMMUTABLE). It returns nil without sealing when the filesystem
// or the caller cannot (ENOTTY, EOPNOTSUPP, EPERM, EACCES: e.g. a non-root
// test on a t.TempDir).
func Seal(path string) error { return setImmutablePath(path, true) }

// Unseal clears the immutable attribute of path; nil if the filesystem or
// the caller cannot.
func Unseal(path string) error { return setImmutablePath(path, false) }

func setImmutablePath(path string, on bool) error {
	fd, err := openForFlags(path)
	if err != nil {
		return fmt.Errorf("seal %s: %w", path, err)
	}
	defer unix.Close(fd)
	return setImmutable(fd, path, on)
}

// openForFlags opens a regular file or directory for the flag ioctls
// (which an O_PATH descriptor cannot do), without following a symlink.
func openForFlags(path string) (int, error) {
	var st unix.Stat_t
	if err := unix.Lstat(path, &st); err != nil {
		return -1, &os.PathError{Op: "lstat", Path: path, Err: err}
	}
	if m := st.Mode & unix.S_IFMT; m != unix.S_IFREG && m != unix.S_IFDIR {
		return -1, fmt.Errorf("%s is neither a regular file nor a directory: %w", path, errdefs.ErrInvalidArgument)
	}
	fd, err := unix.Open(path, unix.O_RDONLY|unix.O_NOFOLLOW|unix.O_NONBLOCK|unix.O_NOCTTY|unix.O_CLOEXEC, 0)
	if err != nil {
		return -1, &os.PathError{Op: "open", Path: path, Err: err}
	}
	return fd, nil
}

// flagsUnsupported reports an ioctl error meaning "this filesystem or this
// caller cannot use inode flags", as opposed to a real failure.
func flagsUnsupported(err error) bool {
	return errors.Is(err, unix.ENOTTY) || errors.Is(err, unix.EOPNOTSUPP) || errors.Is(err, unix.ENOSYS) ||
		errors.Is(err, unix.EPERM) || errors.Is(err, unix.EACCES) || errors.Is(err, unix.EINVAL)
}

func getFlags(fd int) (uint32, error) {
	return unix.IoctlGetUint32(fd, unix.FS_IOC_GETFLAGS)
}

func setFlags(fd int, flags uint32) error {
	return unix.IoctlSetPointerInt(fd, unix.FS_IOC_SETFLAGS, int(flags))
}

// setImmutable sets or clears the immutable flag of the open file fd (named
// path in messages); nil if unsupported.
func setImmutable(fd int, path string, on bool) error {
	flags, err := getFlags(fd)
	if err == nil {
		want := flags &^ fsImmutableFL
		if on {
			want |= fsImmutableFL
		}
		if want == flags {
			return nil
		}
		err = setFlags(fd, want)
	}
	if err == nil {
		return nil
	}
	if flagsUnsupported(err) {
		log.L.WithField("path", path).WithError(err).Debug("memfile: immutable attribute unsupported here, file left unsealed")
		return nil
	}
	return fmt.Errorf("set immutable=%v on %s: %w", on, path, err)
}

// isSealed reports whether path has the immutable flag; ok is false when the
// filesystem has no inode flags.
func isSealed(path string) (sealed, ok bool, err error) {
	fd, err := openForFlags(path)
	if err != nil {
		return false, false, err
	}
	defer unix.Close(fd)
	flags, err := getFlags(fd)
	if err != nil {
		if flagsUnsupported(err) {
			return false, false, nil
		}
		return false, false, err
	}
	return flags&fsImmutableFL != 0, true, nil
}

// removeSealed unlinks path, a file possibly sealed: when the unlink is
// refused, the immutable (and append-only) flag is cleared, the file
// unlinked, and the flag set again if the inode still has other links (a
// view's link, say). A missing file is not an error.
func removeSealed(path string) error {
	err := unix.Unlink(path)
	if err == nil || errors.Is(err, unix.ENOENT) {
		return nil
	}
	if !errors.Is(err, unix.EPERM) {
		return &os.PathError{Op: "unlink", Path: path, Err: err}
	}
	orig := &os.PathError{Op: "unlink", Path: path, Err: err}
	fd, err := openForFlags(path)
	if err != nil {
		return orig
	}
	defer unix.Close(fd)
	flags, err := getFlags(fd)
	if err != nil || flags&(fsImmutableFL|fsAppendFL) == 0 {
		return orig
	}
	if err := setFlags(fd, flags&^(fsImmutableFL|fsAppendFL)); err != nil {
		return fmt.Errorf("unseal %s to remove it: %w", path, err)
	}
	err = unix.Unlink(path)
	var st unix.Stat_t
	if err != nil || (unix.Fstat(fd, &st) == nil && st.Nlink > 0) {
		if err2 := setFlags(fd, flags); err2 != nil {
			log.L.WithField("path", path).WithError(err2).Warn("memfile: cannot seal again a file that has other links")
		}
	}
	if err != nil && !errors.Is(err, unix.ENOENT) {
		return &os.PathError{Op: "unlink", Path: path, Err: err}
	}
	return nil
}

// linkSealed hard links src to dst. A sealed src refuses new links: its flag
// is cleared for the link and set again.
func linkSealed(src, dst string) error {
	err := os.Link(src, dst)
	if err == nil || !errors.Is(err, unix.EPERM) {
		return err
	}
	fd, ferr := openForFlags(src)
	if ferr != nil {
		return err
	}
	defer unix.Close(fd)
	flags, ferr := getFlags(fd)
	if ferr != nil || flags&fsImmutableFL == 0 {
		return err
	}
	if ferr := setFlags(fd, flags&^fsImmutableFL); ferr != nil {
		return fmt.Errorf("unseal %s to link it: %w", src, ferr)
	}
	err = os.Link(src, dst)
	if ferr := setFlags(fd, flags); ferr != nil {
		return errors.Join(err, fmt.Errorf("seal %s again after linking it: %w", src, ferr))
	}
	return err
}

// RemoveAll is os.RemoveAll for trees that may hold sealed files (memory
// files, views): an entry whose removal is refused for its immutable or
// append-only flag has the flag cleared first (and set again if the inode
// still has links outside the tree). For purges, teardowns and test cleanup.
func RemoveAll(path string) error {
	err := os.RemoveAll(path)
	if err == nil || !errors.Is(err, unix.EPERM) {
		return err
	}
	return removeTree(path)
}

func removeTree(path string) error {
	var st unix.Stat_t
	if err := unix.Lstat(path, &st); err != nil {
		if errors.Is(err, unix.ENOENT) {
			return nil
		}
		return &os.PathError{Op: "lstat", Path: path, Err: err}
	}
	if st.Mode&unix.S_IFMT != unix.S_IFDIR {
		return removeSealed(path)
	}
	// A sealed directory refuses the removal of its entries and its own.
	if fd, err := openForFlags(path); err == nil {
		if flags, err := getFlags(fd); err == nil && flags&(fsImmutableFL|fsAppendFL) != 0 {
			setFlags(fd, flags&^(fsImmutableFL|fsAppendFL))
		}
		unix.Close(fd)
	}
	ents, err := os.ReadDir(path)
	if err != nil && !errors.Is(err, os.ErrNotExist) {
		return err
	}
	var errs []error
	for _, e := range ents {
		errs = append(errs, removeTree(filepath.Join(path, e.Name())))
	}
	if err := errors.Join(errs...); err != nil {
		return err
	}
	if err := unix.Rmdir(path); err != nil && !errors.Is(err, unix.ENOENT) {
		return &os.PathError{Op: "rmdir", Path: path, Err: err}
	}
	return nil
}

// sealing reports whether this store's filesystem and this process can seal
// files, found once by sealing a probe file.
func (s *Store) sealing() bool {
	s.sealOnce.Do(func() {
		f, err := os.CreateTemp(filepath.Join(s.root, stateDirName), sealProbePrefix+"*")
		if err != nil {
			return
		}
		defer func() {
			f.Close()
			removeSealed(f.Name())
		}()
		fd := int(f.Fd())
		flags, err := getFlags(fd)
		if err != nil {
			return
		}
		if setFlags(fd, flags|fsImmutableFL) != nil {
			return
		}
		s.sealOK = true
		setFlags(fd, flags)
	})
	return s.sealOK
}

// Verify checks, cheaply, that the named memory files of a family are as a
// rewrite left them: present in the family directory, regular, mode 0400,
// not empty, and immutable when this store can seal files. Each problem is
// an error wrapping errdefs.ErrDataLoss that names the file; bad names are
// ErrInvalidArgument. It reads no file data.
//
// It holds the family lock: a concurrent LinkView clears a file's flag for
// the moment of its link.
func (s *Store) Verify(family string, files []string) error {
	if err := checkFamily(family); err != nil {
		return err
	}
	unlock, err := s.lockFamily(family)
	if err != nil {
		return err
	}
	defer unlock()
	dir := filepath.Join(s.root, family)
	var errs []error
	bad := func(f, what string) {
		errs = append(errs, fmt.Errorf("memory file %s of family %s %s; the containers using it may not be restored or forked correctly: delete them and fork again from a healthy parent: %w",
			f, family, what, errdefs.ErrDataLoss))
	}
	for _, f := range files {
		if err := checkFileName(f); err != nil {
			return err
		}
		p := filepath.Join(dir, f)
		var st unix.Stat_t
		if err := unix.Lstat(p, &st); err != nil {
			bad(f, fmt.Sprintf("is missing (%v)", err))
			continue
		}
		switch {
		case st.Mode&unix.S_IFMT != unix.S_IFREG:
			bad(f, fmt.Sprintf("is not a regular file (mode %#o)", st.Mode))
			continue
		case st.Mode&0o7777 != 0o400:
			bad(f, fmt.Sprintf("has mode %#o, not 0400 (was it modified?)", st.Mode&0o7777))
		case st.Size <= 0:
			bad(f, "is empty (was it truncated?)")
		}
		sealed, ok, err := isSealed(p)
		switch {
		case err != nil:
			bad(f, fmt.Sprintf("cannot be checked (%v)", err))
		case ok && !sealed && s.sealing():
			bad(f, "is not immutable (was it modified?)")
		}
	}
	return errors.Join(errs...)
}
