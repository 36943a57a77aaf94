package memfile

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"time"

	"github.com/checkpoint-restore/go-criu/v7/crit/images/fdinfo"
	remap "github.com/checkpoint-restore/go-criu/v7/crit/images/remap-file-path"
	"github.com/containerd/errdefs"
	"github.com/containerd/log"
	"golang.org/x/sys/unix"

	"github.com/lazyfork/lazyfork/criuimg"
)

// magicRemapFpath is CRIU's REMAP_FPATH image magic (criu/include/magic.h).
const magicRemapFpath = 1494432084

// fileBasePrefix marks a vmaPlan.baseName that is a path under FileRoot,
// not a family file (family file names never contain a NUL).
const fileBasePrefix = "\x00file:"

// fileBase is the verdict on one reg-file of the dump as the base of
// converted .data VMAs: the open file, or why it may not be used.
type fileBase struct {
	f      *os.File
	path   string // under FileRoot, as recorded
	size   int64
	ctime  unix.Timespec
	reason string // non-empty: not usable
}

// fileCheck holds what the checks of reg-files need, read once per rewrite.
type fileCheck struct {
	root     *os.File // FileRoot, opened as a directory
	entries  map[uint32]*fdinfo.FileEntry
	remapped map[uint32]bool // ids CRIU restores through a remap (deleted, ghost or linked files)
	mountNS  bool            // the dump has its own mount namespace (a container)
	rootMnt  int32           // mnt_id of its root mount, -1 if unknown
	dumpTime time.Time       // the earliest image's mtime: the dump did not start later
	bases    map[uint32]*fileBase
}

// initFileCheck prepares the checks when RewriteOptions.FileRoot is set.
func (d *dump) initFileCheck() error {
	if !filepath.IsAbs(d.opts.FileRoot) {
		return fmt.Errorf("FileRoot %q must be an absolute path: %w", d.opts.FileRoot, errdefs.ErrInvalidArgument)
	}
	// A root that is gone (a container's rootfs unmounted after a dump that
	// stopped it) only means no file mapping is converted.
	root, err := os.OpenFile(d.opts.FileRoot, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		log.L.WithError(err).Warn("memfile: file root unusable, .data mappings stay file mappings")
		return nil
	}
	fc := &fileCheck{root: root, entries: map[uint32]*fdinfo.FileEntry{}, remapped: map[uint32]bool{},
		rootMnt: -1, bases: map[uint32]*fileBase{}}
	d.fc = fc
	for _, fe := range d.files.Entries {
		fc.entries[fe.GetId()] = fe
	}
	img, err := criuimg.ReadImage(filepath.Join(d.dir, "remap-fpath.img"), magicRemapFpath, criuimg.Of(&remap.RemapFilePathEntry{}))
	switch {
	case err == nil:
		for _, e := range img.Entries {
			fc.remapped[e.(*remap.RemapFilePathEntry).GetOrigId()] = true
		}
	case !errors.Is(err, errdefs.ErrNotFound):
		return err
	}
	fc.mountNS = d.mountNS
	for _, m := range d.mounts {
		if m.path == "/" {
			fc.rootMnt = m.id
		}
	}
	imgs, _ := filepath.Glob(filepath.Join(d.dir, "*.img"))
	for _, p := range imgs {
		st, err := os.Stat(p)
		if err != nil {
			return err
		}
		if fc.dumpTime.IsZero() || st.ModTime().Before(fc.dumpTime) {
			fc.dumpTime = st.ModTime()
		}
	}
	return nil
}

func (fc *fileCheck) close() {
	if fc == nil {
		return
	}
	fc.root.Close()
	for _, b := range fc.bases {
		if b.f != nil {
			b.f.Close()
		}
	}
}

// base returns the verdict on reg-file id. A file is used only if reading
// it now gives the bytes the dumped process saw: it is the regular file
// the dump recorded (same path under FileRoot, on the container's root
// mount, not remapped), with the recorded size and mode, and it has not
// changed since the dump began (ctime, which no one can set back, is not
// later than the dump's first image). CRIU itself checks only size, mode
// and build-id, which an in-place edit of .data keeps.
func (fc *fileCheck) base(id uint32) *fileBase {
	if b := fc.bases[id]; b != nil {
		return b
	}
	b := fc.check(id)
	fc.bases[id] = b
	return b
}

func (fc *fileCheck) check(id uint32) *fileBase {
	fe := fc.entries[id]
	if fe == nil || fe.GetType() != fdinfo.FdTypes_REG || fe.GetReg() == nil {
		return &fileBase{reason: "not a regular file entry"}
	}
	reg := fe.GetReg()
	b := &fileBase{path: reg.GetName()}
	switch {
	case fc.remapped[id]:
		b.reason = "remapped (deleted or linked) file"
	case reg.Size == nil || reg.Mode == nil:
		b.reason = "size or mode not recorded"
	case !filepath.IsAbs(b.path) || filepath.Clean(b.path) != b.path:
		b.reason = "not a clean absolute path"
	case fc.mountNS && (fc.rootMnt < 0 || reg.GetMntId() != fc.rootMnt):
		b.reason = fmt.Sprintf("on mount %d, not the root mount %d", reg.GetMntId(), fc.rootMnt)
	}
	if b.reason != "" {
		return b
	}
	// Resolve inside FileRoot: symlinks a container planted cannot lead
	// out, and in a container the path must not cross into another mount.
	how := &unix.OpenHow{Flags: unix.O_RDONLY | unix.O_CLOEXEC | unix.O_NOFOLLOW | unix.O_NONBLOCK,
		Resolve: unix.RESOLVE_IN_ROOT | unix.RESOLVE_NO_MAGICLINKS}
	if fc.mountNS {
		how.Resolve |= unix.RESOLVE_NO_XDEV
	}
	fd, err := unix.Openat2(int(fc.root.Fd()), strings.TrimPrefix(b.path, "/"), how)
	if err != nil {
		b.reason = fmt.Sprintf("open: %v", err)
		return b
	}
	f := os.NewFile(uintptr(fd), filepath.Join(fc.root.Name(), b.path))
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil {
		f.Close()
		b.reason = fmt.Sprintf("stat: %v", err)
		return b
	}
	switch {
	case st.Mode&unix.S_IFMT != unix.S_IFREG:
		b.reason = "not a regular file"
	case uint64(st.Size) != reg.GetSize():
		b.reason = fmt.Sprintf("size %d, dump recorded %d", st.Size, reg.GetSize())
	case st.Mode != reg.GetMode():
		b.reason = fmt.Sprintf("mode %#o, dump recorded %#o", st.Mode, reg.GetMode())
	case time.Unix(st.Ctim.Unix()).After(fc.dumpTime):
		b.reason = fmt.Sprintf("changed at %v, after the dump (%v)", time.Unix(st.Ctim.Unix()).UTC(), fc.dumpTime.UTC())
	}
	if b.reason != "" {
		f.Close()
		return b
	}
	b.f, b.size, b.ctime = f, st.Size, st.Ctim
	return b
}

// recheck fails if a file read as a base changed while the rewrite read it:
// the memory file might hold a mix of old and new bytes.
func (fc *fileCheck) recheck() error {
	if fc == nil {
		return nil
	}
	for _, b := range fc.bases {
		if b.f == nil {
			continue
		}
		var st unix.Stat_t
		if err := unix.Fstat(int(b.f.Fd()), &st); err != nil {
			return err
		}
		if st.Size != b.size || st.Ctim != b.ctime {
			return fmt.Errorf("%s changed while the rewrite read it: %w", b.path, errdefs.ErrFailedPrecondition)
		}
	}
	return nil
}
