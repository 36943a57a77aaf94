package memfile

import (
	"archive/tar"
	"compress/gzip"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"

	"github.com/checkpoint-restore/go-criu/v7/crit/images/mnt"
	"github.com/containerd/errdefs"

	"github.com/lazyfork/lazyfork/criuimg"
)

// A container's tmpfs mounts (/dev, /dev/shm, /run, the tmpfs runc mounts
// over masked directories) are dumped by CRIU 4.1 as a tar.gz of their
// contents, tmpfs-dev-<dev>.tar.gz.img, and restored by mounting a new tmpfs
// and running `tar --extract --gzip` into it: a tar and a gzip exec per
// mount and per restore (criu/filesystems.c, tmpfs_restore), 3-10 ms each,
// even where the mount holds nothing but its root directory.
//
// CRIU mounts an entry of type FSTYPE__AUTO with fsname "tmpfs" as a plain
// new tmpfs with the entry's source, flags and options, and runs no restore
// callback for it (criu/mount.c, do_new_mount and mnt_fsname; a tmpfs has an
// anonymous device, so resolve_source takes the entry's source). For a tmpfs
// whose dump holds only its root directory, with the mode and owner the mount
// options give a new tmpfs, the two restores make the same mount but for the
// root directory's times. So the rewrite, once per snapshot, turns such
// mounts into AUTO mounts and drops their tar images: no fork of the snapshot
// runs tar for them. A tmpfs with contents (/dev, with runc's device nodes,
// or a /dev/shm the program wrote to) keeps CRIU's tar path.
//
// The image stays a standard CRIU image: CRIU writes such entries itself for
// a filesystem named in --enable-fs, so a plain CRIU or runc restore of an
// export of the snapshot makes the same mounts.

// tmpfsMode, tmpfsUID and tmpfsGID are the root directory of a new tmpfs
// whose options do not name them (mm/shmem.c: 01777, and the mounter's
// fsuid and fsgid: CRIU restores as root).
const (
	tmpfsMode = 0o1777
	tmpfsUID  = 0
	tmpfsGID  = 0
)

// tmpfsTarMax bounds the bytes read from a tmpfs tar image to decide whether
// it holds only its root directory (that takes well under 1 KiB).
const tmpfsTarMax = 64 << 10

// autoMountEmptyTmpfs turns the empty tmpfs mounts of the staged image in
// dir into FSTYPE__AUTO mounts of fsname "tmpfs" and removes their tar
// images (see above). dir's files may be hard links to the dump's: a changed
// image is written as a new file. It returns the mount points it turned.
//
// A superblock (root_dev) is turned only if every entry of it, in every
// mount namespace, is a tmpfs of the dump's own (not external, no plugin,
// not deleted, no master), mounted at its root, on an anonymous device, and
// its tar image holds only the root directory with the mode and owner its
// options give. Anything else keeps its entry as CRIU wrote it.
func autoMountEmptyTmpfs(dir string) ([]string, error) {
	paths, _ := filepath.Glob(filepath.Join(dir, "mountpoints-*.img"))
	if len(paths) == 0 {
		return nil, nil
	}
	imgs := make([]*criuimg.Image, len(paths))
	bySB := map[uint32][]*mnt.MntEntry{}
	for i, p := range paths {
		img, err := criuimg.ReadImage(p, criuimg.MagicMnts, criuimg.KindOf(p).NewEntry)
		if err != nil {
			return nil, err
		}
		imgs[i] = img
		for _, e := range img.Entries {
			m, ok := e.(*mnt.MntEntry)
			if !ok {
				return nil, fmt.Errorf("%s: entry of type %T, not a mount: %w", p, e, errdefs.ErrDataLoss)
			}
			bySB[m.GetRootDev()] = append(bySB[m.GetRootDev()], m)
		}
	}
	var turned []string
	changed := map[int]bool{}
	for dev, ms := range bySB {
		if !ownTmpfs(dev, ms) {
			continue
		}
		tarPath := filepath.Join(dir, "tmpfs-dev-"+strconv.FormatUint(uint64(dev), 10)+".tar.gz.img")
		empty, err := tmpfsTarEmpty(tarPath, ms[0].GetOptions())
		if err != nil {
			return nil, err
		}
		if !empty {
			continue
		}
		for _, m := range ms {
			m.Fstype = ptr(uint32(mnt.Fstype_AUTO))
			m.Fsname = ptr("tmpfs")
			turned = append(turned, mountPath(m.GetMountpoint()))
		}
		if err := os.Remove(tarPath); err != nil {
			return nil, err
		}
		for i, img := range imgs {
			for _, e := range img.Entries {
				if e.(*mnt.MntEntry).GetRootDev() == dev {
					changed[i] = true
				}
			}
		}
	}
	for i := range changed {
		// A new file: the staged one may be a hard link to the dump's.
		if err := os.Remove(paths[i]); err != nil {
			return nil, err
		}
		if err := criuimg.WriteImage(paths[i], imgs[i]); err != nil {
			return nil, err
		}
	}
	slices.Sort(turned)
	return turned, nil
}

// ownTmpfs reports whether the mounts of superblock dev are all tmpfs
// mounts CRIU restores by mounting a new tmpfs and untarring its contents
// into it.
func ownTmpfs(dev uint32, ms []*mnt.MntEntry) bool {
	if dev>>20 != 0 { // kdev_major: a tmpfs has an anonymous device (major 0)
		return false
	}
	for _, m := range ms {
		if m.GetFstype() != uint32(mnt.Fstype_TMPFS) || m.Fsname != nil || m.GetRoot() != "/" ||
			m.GetExtMount() || m.GetExtKey() != "" || m.GetWithPlugin() || m.GetDeleted() || m.GetMasterId() != 0 {
			return false
		}
		if m.GetOptions() != ms[0].GetOptions() || m.GetSource() != ms[0].GetSource() {
			return false
		}
	}
	return true
}

// tmpfsTarEmpty reports whether the tmpfs tar image at path holds only the
// root directory, with the mode and owner a new tmpfs mounted with options
// has. A missing image is not empty (the mount is left to CRIU).
func tmpfsTarEmpty(path, options string) (bool, error) {
	f, err := os.Open(path)
	if errors.Is(err, os.ErrNotExist) {
		return false, nil
	}
	if err != nil {
		return false, err
	}
	defer f.Close()
	// What this cannot read is left to CRIU's tar, which reports it.
	zr, err := gzip.NewReader(io.LimitReader(f, tmpfsTarMax))
	if err != nil {
		return false, nil
	}
	tr := tar.NewReader(io.LimitReader(zr, tmpfsTarMax))
	h, err := tr.Next()
	if err != nil {
		return false, nil
	}
	if h.Typeflag != tar.TypeDir || strings.Trim(h.Name, "/") != "." {
		return false, nil
	}
	if _, err := tr.Next(); !errors.Is(err, io.EOF) {
		return false, nil // more entries, or unreadable
	}
	mode, uid, gid, ok := tmpfsRoot(options)
	return ok && h.Mode&0o7777 == mode && h.Uid == uid && h.Gid == gid, nil
}

// tmpfsRoot is the mode and owner of a new tmpfs's root directory mounted
// with options (as /proc's mountinfo shows them). ok is false for options
// it cannot read.
func tmpfsRoot(options string) (mode int64, uid, gid int, ok bool) {
	mode, uid, gid = tmpfsMode, tmpfsUID, tmpfsGID
	for _, o := range strings.Split(options, ",") {
		k, v, _ := strings.Cut(o, "=")
		var err error
		switch k {
		case "mode":
			mode, err = strconv.ParseInt(v, 8, 32)
		case "uid":
			uid, err = strconv.Atoi(v)
		case "gid":
			gid, err = strconv.Atoi(v)
		}
		if err != nil {
			return 0, 0, 0, false
		}
	}
	return mode & 0o7777, uid, gid, true
}

// mountPath is a CRIU mountpoint ("./x" or "/x") as an absolute clean path.
func mountPath(p string) string {
	return "/" + strings.Trim(strings.TrimPrefix(p, "."), "/")
}
