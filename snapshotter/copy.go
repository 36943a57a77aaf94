//go:build linux

package snapshotter

import (
	"context"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"time"

	"golang.org/x/sys/unix"
)

// CopyStats says what a layer copy did and how.
type CopyStats struct {
	Files, Dirs, Others int   // regular files, directories, everything else
	Links               int   // extra hard links recreated as links
	Bytes               int64 // apparent size of the regular files
	Reflinked           int   // files cloned with FICLONE (no data copied)
	Copied              int   // files copied with copy_file_range or read/write
	Reused              int   // files taken unchanged from an earlier copy (hard link)
	Vanished            int   // entries gone during a live copy (skipped)
	Duration            time.Duration
}

// CopyLayer copies the overlay layer src into the empty directory dst,
// keeping what overlayfs and the container rely on: owners, modes, times,
// all xattrs (overlay's opaque dirs are trusted.overlay.* xattrs), device
// nodes (whiteouts are 0/0 character devices), hard links among the copied
// files, and holes. File data is reflinked where the filesystem can
// (btrfs, xfs), else copied in the kernel with copy_file_range.
func CopyLayer(ctx context.Context, dst, src string, opts ...CopyOption) (CopyStats, error) {
	start := time.Now()
	c := layerCopier{ctx: ctx, links: map[fileID]string{}}
	for _, o := range opts {
		o(&c)
	}
	err := c.copy(dst, src)
	c.stats.Duration = time.Since(start)
	return c.stats, err
}

// CopyOption changes CopyLayer.
type CopyOption func(*layerCopier)

// WithPlainCopy copies the data with read and write, as a copy in user
// space does (for comparisons): no reflink, and no copy_file_range, which
// XFS and btrfs turn into a reflink too.
func WithPlainCopy() CopyOption {
	return func(c *layerCopier) { c.noReflink, c.plain = true, true }
}

// withLive marks the source as possibly changing under the copy.
func withLive() CopyOption { return func(c *layerCopier) { c.live = true } }

// withReuse links files unchanged since before from the earlier copy prev.
func withReuse(prev string, before unix.Timespec) CopyOption {
	return func(c *layerCopier) { c.reuse, c.reuseBefore = prev, before }
}

func tsBefore(a, b unix.Timespec) bool {
	return a.Sec < b.Sec || (a.Sec == b.Sec && a.Nsec < b.Nsec)
}

func copyLayer(ctx context.Context, dst, src string) error {
	_, err := CopyLayer(ctx, dst, src)
	return err
}

type fileID struct{ dev, ino uint64 }

type layerCopier struct {
	ctx   context.Context
	links map[fileID]string
	stats CopyStats
	// live: the source may change under the copy (a running container):
	// entries that vanish are skipped, and each file is fsynced before it
	// is read, so that later writes through a shared mapping fault again
	// and move its ctime.
	live bool
	// reuse, when set, is an earlier copy of the same source; a regular
	// file whose ctime is before reuseBefore is hard-linked from there.
	reuse       string
	reuseBefore unix.Timespec
	// noReflink remembers that the filesystem refused a clone, so the
	// remaining files skip the attempt.
	noReflink bool
	plain     bool
	buf       []byte
}

type dirTimes struct {
	path string
	st   *unix.Stat_t
}

func (c *layerCopier) copy(dst, src string) error {
	var dirs []dirTimes
	err := filepath.WalkDir(src, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			if c.live && errors.Is(err, fs.ErrNotExist) && p != src {
				c.stats.Vanished++
				if d != nil && d.IsDir() {
					return filepath.SkipDir
				}
				return nil
			}
			return err
		}
		if err := c.ctx.Err(); err != nil {
			return err
		}
		rel, err := filepath.Rel(src, p)
		if err != nil {
			return err
		}
		target := filepath.Join(dst, rel)
		var st unix.Stat_t
		if err := unix.Lstat(p, &st); err != nil {
			if c.live && errors.Is(err, unix.ENOENT) {
				c.stats.Vanished++
				return nil
			}
			return &os.PathError{Op: "lstat", Path: p, Err: err}
		}
		switch st.Mode & unix.S_IFMT {
		case unix.S_IFDIR:
			if rel != "." {
				if err := os.Mkdir(target, 0o700); err != nil {
					return err
				}
			}
			c.stats.Dirs++
			dirs = append(dirs, dirTimes{target, &st})
			// Times are set after the children are in place.
			return c.meta(target, p, &st, false)
		case unix.S_IFREG:
			id := fileID{uint64(st.Dev), st.Ino}
			if st.Nlink > 1 {
				if first, ok := c.links[id]; ok {
					c.stats.Links++
					return os.Link(first, target)
				}
				c.links[id] = target
			}
			if c.reused(target, rel, &st) {
				c.stats.Reused++
			} else if err := c.copyFile(target, p, &st); err != nil {
				if c.live && errors.Is(err, fs.ErrNotExist) {
					c.stats.Vanished++
					delete(c.links, id)
					return nil
				}
				return err
			}
			c.stats.Files++
			c.stats.Bytes += st.Size
		case unix.S_IFLNK:
			dest, err := os.Readlink(p)
			if err != nil {
				return err
			}
			if err := os.Symlink(dest, target); err != nil {
				return err
			}
			c.stats.Others++
		case unix.S_IFCHR, unix.S_IFBLK, unix.S_IFIFO, unix.S_IFSOCK:
			if err := unix.Mknod(target, st.Mode, int(st.Rdev)); err != nil {
				return &os.PathError{Op: "mknod", Path: target, Err: err}
			}
			c.stats.Others++
		default:
			return fmt.Errorf("%s: unknown file type %o", p, st.Mode&unix.S_IFMT)
		}
		return c.meta(target, p, &st, true)
	})
	if err != nil {
		return err
	}
	for i := len(dirs) - 1; i >= 0; i-- {
		if err := setTimes(dirs[i].path, dirs[i].st); err != nil {
			return err
		}
	}
	return nil
}

// meta copies owner, xattrs, mode and (unless a dir) times, in the order
// that keeps them: chown clears setuid bits, so chmod comes after it.
func (c *layerCopier) meta(target, src string, st *unix.Stat_t, times bool) error {
	if err := unix.Lchown(target, int(st.Uid), int(st.Gid)); err != nil {
		return &os.PathError{Op: "lchown", Path: target, Err: err}
	}
	if err := copyXattrs(target, src); err != nil {
		return err
	}
	if st.Mode&unix.S_IFMT != unix.S_IFLNK {
		if err := unix.Chmod(target, st.Mode&0o7777); err != nil {
			return &os.PathError{Op: "chmod", Path: target, Err: err}
		}
	}
	if times {
		return setTimes(target, st)
	}
	return nil
}

func setTimes(p string, st *unix.Stat_t) error {
	ts := []unix.Timespec{st.Atim, st.Mtim}
	if err := unix.UtimesNanoAt(unix.AT_FDCWD, p, ts, unix.AT_SYMLINK_NOFOLLOW); err != nil {
		return &os.PathError{Op: "utimes", Path: p, Err: err}
	}
	return nil
}

func copyXattrs(dst, src string) error {
	size, err := unix.Llistxattr(src, nil)
	if err != nil {
		if errors.Is(err, unix.ENOTSUP) {
			return nil
		}
		return &os.PathError{Op: "llistxattr", Path: src, Err: err}
	}
	if size == 0 {
		return nil
	}
	names := make([]byte, size)
	size, err = unix.Llistxattr(src, names)
	if err != nil {
		return &os.PathError{Op: "llistxattr", Path: src, Err: err}
	}
	names = names[:size]
	for len(names) > 0 {
		i := 0
		for i < len(names) && names[i] != 0 {
			i++
		}
		name := string(names[:i])
		if i < len(names) {
			i++
		}
		names = names[i:]
		if name == "" {
			continue
		}
		vsize, err := unix.Lgetxattr(src, name, nil)
		if err != nil {
			return &os.PathError{Op: "lgetxattr " + name, Path: src, Err: err}
		}
		val := make([]byte, vsize)
		if vsize > 0 {
			if vsize, err = unix.Lgetxattr(src, name, val); err != nil {
				return &os.PathError{Op: "lgetxattr " + name, Path: src, Err: err}
			}
			val = val[:vsize]
		}
		if err := unix.Lsetxattr(dst, name, val, 0); err != nil {
			return &os.PathError{Op: "lsetxattr " + name, Path: dst, Err: err}
		}
	}
	return nil
}

// reused links target to the earlier copy of rel when the source file has
// not changed since that copy began: its ctime (moved by every write, fault
// on a clean shared page, chmod, chown, xattr change, link, unlink and
// rename) predates the copy, and size and mtime agree.
func (c *layerCopier) reused(target, rel string, st *unix.Stat_t) bool {
	if c.reuse == "" || !tsBefore(st.Ctim, c.reuseBefore) {
		return false
	}
	prev := filepath.Join(c.reuse, rel)
	var pst unix.Stat_t
	if err := unix.Lstat(prev, &pst); err != nil {
		return false
	}
	if pst.Mode&unix.S_IFMT != unix.S_IFREG || pst.Size != st.Size || pst.Mtim != st.Mtim {
		return false
	}
	return os.Link(prev, target) == nil
}

func (c *layerCopier) copyFile(target, src string, st *unix.Stat_t) error {
	in, err := os.Open(src)
	if err != nil {
		return err
	}
	defer in.Close()
	if c.live {
		// Write back dirty pages: a later write through a mapping must
		// fault again (page_mkwrite), which moves ctime, for the sync pass
		// to see it.
		if err := in.Sync(); err != nil {
			return fmt.Errorf("fsync %s: %w", src, err)
		}
	}
	out, err := os.OpenFile(target, os.O_WRONLY|os.O_CREATE|os.O_EXCL, 0o600)
	if err != nil {
		return err
	}
	if err := c.copyData(out, in, st.Size); err != nil {
		out.Close()
		return fmt.Errorf("copy %s: %w", src, err)
	}
	return out.Close()
}

func (c *layerCopier) copyData(out, in *os.File, size int64) error {
	if size == 0 {
		return nil
	}
	if !c.noReflink {
		err := unix.IoctlFileClone(int(out.Fd()), int(in.Fd()))
		if err == nil {
			c.stats.Reflinked++
			return nil
		}
		// EOPNOTSUPP/EINVAL (ext4, tmpfs), EXDEV (another fs): copy instead.
		c.noReflink = true
	}
	c.stats.Copied++
	// Copy the data extents only, so a sparse file stays sparse.
	var off int64
	for off < size {
		data, err := unix.Seek(int(in.Fd()), off, unix.SEEK_DATA)
		if errors.Is(err, unix.ENXIO) {
			break // only a hole remains
		}
		if err != nil {
			// No SEEK_DATA support: treat everything as data.
			data = off
		}
		hole, err := unix.Seek(int(in.Fd()), data, unix.SEEK_HOLE)
		if err != nil {
			hole = size
		}
		if hole > size {
			hole = size
		}
		if err := c.copyRange(out, in, data, hole-data); err != nil {
			return err
		}
		off = hole
	}
	return out.Truncate(size)
}

func (c *layerCopier) copyRange(out, in *os.File, off, n int64) error {
	if c.plain {
		return c.readWrite(out, in, off, n)
	}
	for n > 0 {
		// 64 MiB at a time, so that a cancelled freeze stops soon.
		if err := c.ctx.Err(); err != nil {
			return err
		}
		roff, woff := off, off
		w, err := unix.CopyFileRange(int(in.Fd()), &roff, int(out.Fd()), &woff, int(min(n, 64<<20)), 0)
		if err != nil || w == 0 {
			// EXDEV/ENOSYS/EINVAL or a short source: plain read/write.
			return c.readWrite(out, in, off, n)
		}
		off += int64(w)
		n -= int64(w)
	}
	return nil
}

func (c *layerCopier) readWrite(out, in *os.File, off, n int64) error {
	if c.buf == nil {
		c.buf = make([]byte, 1<<20)
	}
	_, err := io.CopyBuffer(io.NewOffsetWriter(out, off), ctxReader{c.ctx, io.NewSectionReader(in, off, n)}, c.buf)
	return err
}

// ctxReader stops a read/write copy when its context is cancelled.
type ctxReader struct {
	ctx context.Context
	r   io.Reader
}

func (r ctxReader) Read(p []byte) (int, error) {
	if err := r.ctx.Err(); err != nil {
		return 0, err
	}
	return r.r.Read(p)
}
