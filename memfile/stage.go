package memfile

import (
	"context"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"time"

	"github.com/checkpoint-restore/go-criu/v7/crit/images/fdinfo"
	"github.com/checkpoint-restore/go-criu/v7/crit/images/fown"
	"github.com/checkpoint-restore/go-criu/v7/crit/images/regfile"
	"github.com/containerd/errdefs"
	"github.com/containerd/log"
	"golang.org/x/sys/unix"
	"google.golang.org/protobuf/proto"

	"github.com/lazyfork/lazyfork/criuimg"
)

const stagingInfix = ".lazyfork-stage-"

// removeStaleStaging removes staging directories a crashed rewrite of
// imageDir left beside it.
func removeStaleStaging(imageDir string) {
	old, _ := filepath.Glob(imageDir + stagingInfix + "*")
	for _, d := range old {
		os.RemoveAll(d)
	}
}

// staged is what the staging phase built: the complete new image in a
// directory beside the image directory, and its snapshot record.
type staged struct {
	dir       string
	info      SnapshotInfo
	premapped []uint32 // tasks given an empty parent pagemap (premapDir)
}

// abort removes a staging directory that was not swapped in.
func (st *staged) abort() {
	if st != nil && st.dir != "" {
		os.RemoveAll(st.dir)
	}
}

// stageImage builds the complete new image beside the dump's directory
// (phase 4): unchanged files hard linked, changed ones written anew, with
// the converted VMAs mapping mf's regions. On error nothing is left.
func stageImage(ctx context.Context, d *dump, pl planned, mf *memFile) (*staged, error) {
	fi, err := os.Stat(d.dir)
	if err != nil {
		return nil, err
	}
	sg := &stager{d: d, pl: pl, mf: mf, cp: newCopier(), out: &staged{dir: d.dir + stagingInfix + randHex(6)}}
	if err := os.Mkdir(sg.out.dir, 0o700); err != nil {
		return nil, err
	}
	if err := sg.stage(ctx, fi.Mode().Perm()); err != nil {
		sg.out.abort()
		return nil, err
	}
	return sg.out, nil
}

// stager builds a staged image.
type stager struct {
	d      *dump
	pl     planned
	mf     *memFile
	cp     *copier
	clones []*fdinfo.FileEntry // files.img entries added by splitCOWIDs
	added  []*fdinfo.FileEntry // files.img entries of previous snapshots' patch files (expandPatched)
	nextID uint32              // the next free files.img id
	out    *staged
}

func (sg *stager) stage(ctx context.Context, perm os.FileMode) error {
	d, mf := sg.d, sg.mf
	// The swapped-in directory keeps the image directory's mode.
	if err := os.Chmod(sg.out.dir, perm); err != nil {
		return err
	}
	sg.nextID = d.files.MaxID() + 1
	if len(mf.regions) > 0 {
		sg.nextID++ // the new memory file's entry
	}
	patches, err := sg.expandPatched(mf.name())
	if err != nil {
		return err
	}
	// Converted VMAs now map their regions; only then can file ids that
	// CRIU would wrongly share be told apart.
	for _, t := range d.tasks {
		for _, p := range t.vmas {
			if p.convert {
				v := p.e
				v.Status = ptr(v.GetStatus()&^vmaAnonPrivate | vmaFilePrivate)
				v.Flags = ptr(v.GetFlags() &^ unix.MAP_ANONYMOUS)
				v.Shmid = ptr(uint64(p.region.regID))
				v.Pgoff = ptr(uint64(p.regOff))
				v.Fdflags = ptr(uint32(unix.O_RDONLY))
			}
		}
	}
	var memInfo os.FileInfo
	var memEntry *fdinfo.FileEntry
	if mf.file != nil {
		if memInfo, err = mf.file.f.Stat(); err != nil {
			return err
		}
		if len(mf.regions) > 0 {
			memEntry = sg.regFile(mf.regions[0].regID, memInfo, uint32(memInfo.Mode().Perm())|unix.S_IFREG)
		}
	}
	if err := sg.splitCOWIDs(memEntry); err != nil {
		return err
	}
	rewritten := map[string]bool{criuimg.FilesPath(d.dir): true, filepath.Join(d.dir, SnapshotFile): true,
		filepath.Join(d.dir, premapDir): true}
	for _, t := range d.tasks {
		if t.changed {
			rewritten[criuimg.MMPath(d.dir, t.pid)] = true
			rewritten[criuimg.PagemapPath(d.dir, t.pid)] = true
			rewritten[criuimg.PagesPath(d.dir, t.pm.PagesID)] = true
		}
	}
	inv, err := inventorySkippingNetworkLock(d.dir, d.files)
	if err != nil {
		return err
	}
	if inv != nil {
		rewritten[criuimg.InventoryPath(d.dir)] = true
	}
	if err := linkTree(d.dir, sg.out.dir, rewritten); err != nil {
		return fmt.Errorf("staging: %w", err)
	}
	if inv != nil {
		if err := criuimg.WriteImage(criuimg.InventoryPath(sg.out.dir), inv); err != nil {
			return err
		}
	}
	if turned, err := autoMountEmptyTmpfs(sg.out.dir); err != nil {
		return fmt.Errorf("staging: empty tmpfs mounts: %w", err)
	} else if len(turned) > 0 {
		log.G(ctx).WithField("mounts", turned).Debug("memfile: empty tmpfs mounts restore without tar")
	}
	var kept, mapped uint64
	var fdIDs map[uint32]bool
	for _, t := range d.tasks {
		if err := ctx.Err(); err != nil {
			return err
		}
		if t.mm == nil {
			continue
		}
		var stay []run
		for _, p := range t.vmas {
			switch {
			case p.kind == vmaWipe:
			case p.convert:
				stay = append(stay, p.kept...)
			default:
				stay = append(stay, p.overlay...)
			}
		}
		for _, r := range stay {
			kept += r.n
		}
		if !t.changed {
			continue
		}
		if err := criuimg.WriteImage(criuimg.MMPath(sg.out.dir, t.pid), t.mm.Image); err != nil {
			return err
		}
		pm, runs := pagemapFrom(t.pm, stay)
		if err := criuimg.WriteImage(criuimg.PagemapPath(sg.out.dir, t.pid), pm.Image()); err != nil {
			return err
		}
		if err := sg.writePages(criuimg.PagesPath(sg.out.dir, t.pm.PagesID), runs); err != nil {
			return err
		}
	}

	if sg.out.premapped, err = writePremap(d, sg.out.dir); err != nil {
		return err
	}

	// files.img: one entry for the new memory file, and no entry for a family file that
	// nothing uses any more (a rebase left it behind).
	used := map[uint32]bool{}
	for _, t := range d.tasks {
		if t.mm == nil {
			continue
		}
		for _, p := range t.vmas {
			if p.e.GetStatus()&(vmaFilePrivate|vmaFileShared) != 0 {
				used[uint32(p.e.GetShmid())] = true
			}
		}
		used[t.mm.MM.GetExeFileId()] = true
	}
	fdIDs, err = fdinfoIDs(d.dir)
	if err != nil {
		return err
	}
	for id := range fdIDs {
		used[id] = true
	}
	files := &criuimg.FilesImage{Image: &criuimg.Image{Head: d.files.Image.Head, Magic: d.files.Image.Magic}}
	pinned := map[string]bool{}
	for _, fe := range d.files.Entries {
		if name, ok := d.famFiles[fe.GetId()]; ok {
			if !used[fe.GetId()] {
				continue
			}
			pinned[name] = true
		}
		files.Add(fe)
	}
	if memEntry != nil {
		files.Add(memEntry)
	}
	for _, fe := range slices.Concat(sg.added, sg.clones) {
		files.Add(fe)
		if name, ok := d.famFiles[fe.GetId()]; ok {
			pinned[name] = true
		}
	}
	if len(mf.regions) > 0 {
		pinned[mf.name()] = true
	}
	if err := criuimg.WriteImage(criuimg.FilesPath(sg.out.dir), files.Image); err != nil {
		return err
	}

	// What the image maps from files, for the snapshot record.
	seen := map[[2]int64]bool{}
	for _, t := range d.tasks {
		if t.mm == nil {
			continue
		}
		for _, p := range t.vmas {
			var f *os.File
			var off int64
			switch {
			case p.convert:
				f, off = mf.file.f, p.regOff
			case p.kind == vmaFamily:
				f, off = p.base, p.baseOff
			default:
				continue
			}
			k := [2]int64{int64(f.Fd()), off}
			if seen[k] {
				continue
			}
			seen[k] = true
			n, err := d.extents.dataPages(f, off, int64(p.pages()*pageSize))
			if err != nil {
				return err
			}
			mapped += n
		}
	}
	sg.out.info = SnapshotInfo{
		Family: d.opts.Family, Pages: mapped, KeptPages: kept, MapDir: d.opts.MapDir,
		Rebased: sg.pl.rebase, Created: time.Now().UTC(), Patches: patches,
	}
	for name := range pinned {
		sg.out.info.Files = append(sg.out.info.Files, name)
	}
	slices.Sort(sg.out.info.Files)
	// The parent is the newest file a delta sits on (names sort by time).
	for _, name := range sg.out.info.Files {
		if name != mf.name() {
			sg.out.info.Parent = name
		}
	}
	return writeJSONAtomic(filepath.Join(sg.out.dir, SnapshotFile), &sg.out.info, 0o644)
}

// writePages writes a pages image holding runs back to back.
func (sg *stager) writePages(path string, runs []run) error {
	f, err := os.OpenFile(path, os.O_RDWR|os.O_CREATE|os.O_EXCL, 0o644)
	if err != nil {
		return err
	}
	defer f.Close()
	var off int64
	for _, r := range runs {
		n := int64(r.n * pageSize)
		if r.kind == srcFile {
			if err := sg.cp.copy(f, off, r.f, r.off, n); err != nil {
				return err
			}
		}
		off += n
	}
	// Zero runs are holes; make the file whole.
	if err := f.Truncate(off); err != nil {
		return err
	}
	return nil
}

// fdinfoIDs returns the file ids open as descriptors in any task.
func fdinfoIDs(dir string) (map[uint32]bool, error) {
	ids := map[uint32]bool{}
	paths, _ := filepath.Glob(filepath.Join(dir, "fdinfo-*.img"))
	for _, p := range paths {
		img, err := criuimg.ReadImage(p, criuimg.MagicFdinfo, criuimg.Of(&fdinfo.FdinfoEntry{}))
		if err != nil {
			return nil, err
		}
		for _, e := range img.Entries {
			ids[e.(*fdinfo.FdinfoEntry).GetId()] = true
		}
	}
	return ids, nil
}

// linkTree hard links every file of src into dst (same filesystem), except
// the skipped paths; directories are recreated and symlinks copied.
func linkTree(src, dst string, skip map[string]bool) error {
	return filepath.WalkDir(src, func(path string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		rel, _ := filepath.Rel(src, path)
		target := filepath.Join(dst, rel)
		switch {
		case rel == ".":
			return nil
		case d.IsDir() && skip[path]:
			return fs.SkipDir
		case d.IsDir():
			info, err := d.Info()
			if err != nil {
				return err
			}
			return os.Mkdir(target, info.Mode().Perm())
		case skip[path]:
			return nil
		case d.Type()&fs.ModeSymlink != 0:
			l, err := os.Readlink(path)
			if err != nil {
				return err
			}
			return os.Symlink(l, target)
		}
		return os.Link(path, target)
	})
}

// splitCOWIDs works around CRIU's test for copy-on-write sharing between a
// parent's and a child's VMA (criu/mem.c, check_cow_vmas): same start, end
// and file id, but not the same offset. A dump of a restored copy, and the
// rewrite itself, give every mapping of one memory file the same file id, so a child whose VMA maps its
// own region at the address where its parent maps another region of that
// file would be restored with the parent's contents. Such a child VMA gets a
// file id of its own (a clone of the files.img entry).
func (sg *stager) splitCOWIDs(memEntry *fdinfo.FileEntry) error {
	d := sg.d
	byPID := map[uint32]*task{}
	for _, t := range d.tasks {
		byPID[t.pid] = t
	}
	entries := map[uint32]*fdinfo.FileEntry{}
	for _, fe := range d.files.Entries {
		entries[fe.GetId()] = fe
	}
	if memEntry != nil {
		entries[memEntry.GetId()] = memEntry
	}
	for _, fe := range sg.added {
		entries[fe.GetId()] = fe
	}
	for _, t := range d.tasks {
		parent := byPID[t.ppid]
		if t.mm == nil || parent == nil || parent.mm == nil {
			continue
		}
		type key struct{ start, end, shmid uint64 }
		pv := map[key]uint64{}
		for _, p := range parent.vmas {
			if p.e.GetStatus()&vmaFilePrivate != 0 {
				pv[key{p.e.GetStart(), p.e.GetEnd(), p.e.GetShmid()}] = p.e.GetPgoff()
			}
		}
		for _, p := range t.vmas {
			v := p.e
			if v.GetStatus()&vmaFilePrivate == 0 {
				continue
			}
			off, ok := pv[key{v.GetStart(), v.GetEnd(), v.GetShmid()}]
			if !ok || off == v.GetPgoff() {
				continue
			}
			orig := entries[uint32(v.GetShmid())]
			if orig == nil || orig.GetReg() == nil {
				return fmt.Errorf("pid %d: VMA %#x maps file id %d, missing from files.img: %w", t.pid, v.GetStart(), v.GetShmid(), errdefs.ErrDataLoss)
			}
			next := sg.nextID
			sg.nextID++
			clone := proto.Clone(orig).(*fdinfo.FileEntry)
			clone.Id = ptr(next)
			clone.Reg.Id = ptr(next)
			sg.clones = append(sg.clones, clone)
			if name, ok := d.famFiles[orig.GetId()]; ok {
				d.famFiles[next] = name
			}
			v.Shmid = ptr(uint64(next))
			t.changed = true
		}
	}
	return nil
}

// regFile builds the files.img entry for a region of the new memory file.
func (sg *stager) regFile(id uint32, st os.FileInfo, mode uint32) *fdinfo.FileEntry {
	return sg.regFileNamed(id, sg.mf.name(), st, mode)
}

// regFileNamed builds the files.img entry of family file name.
func (sg *stager) regFileNamed(id uint32, name string, st os.FileInfo, mode uint32) *fdinfo.FileEntry {
	zero := ptr(uint32(0))
	reg := &regfile.RegFileEntry{
		Id:    ptr(id),
		Flags: ptr(uint32(unix.O_RDONLY | unix.O_LARGEFILE)),
		Pos:   ptr(uint64(0)),
		Fown:  &fown.FownEntry{Uid: zero, Euid: zero, Signum: zero, PidType: zero, Pid: zero},
		Name:  ptr(sg.d.opts.MapDir + "/" + name),
		Size:  ptr(uint64(st.Size())),
		Mode:  ptr(mode),
	}
	if sg.d.mntID != nil {
		reg.MntId = sg.d.mntID
	}
	return &fdinfo.FileEntry{Type: fdinfo.FdTypes_REG.Enum(), Id: ptr(id), Reg: reg}
}
