package memfile

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"time"

	"github.com/checkpoint-restore/go-criu/v7/crit/images/fdinfo"
	"github.com/containerd/errdefs"
	"github.com/lazyfork/lazyfork/criuimg"
	"golang.org/x/sys/unix"
	"google.golang.org/protobuf/proto"
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

// stage builds the complete new image beside imageDir: unchanged files hard
// linked, changed ones written anew.
func (rw *rewriter) stage(ctx context.Context) error {
	st, err := os.Stat(rw.imageDir)
	if err != nil {
		return err
	}
	rw.staging = rw.imageDir + stagingInfix + randHex(6)
	if err := os.Mkdir(rw.staging, 0o700); err != nil {
		return err
	}
	// The swapped-in directory keeps the image directory's mode.
	if err := os.Chmod(rw.staging, st.Mode().Perm()); err != nil {
		return err
	}
	// Converted VMAs now map their regions; only then can file ids that
	// CRIU would wrongly share be told apart.
	for _, t := range rw.tasks {
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
	if rw.mem != nil {
		var err error
		if memInfo, err = rw.mem.Stat(); err != nil {
			return err
		}
		if len(rw.regions) > 0 {
			memEntry = rw.regFile(rw.regions[0].regID, memInfo, uint32(memInfo.Mode().Perm())|unix.S_IFREG)
		}
	}
	if err := rw.splitCOWIDs(memEntry); err != nil {
		return err
	}
	rewritten := map[string]bool{criuimg.FilesPath(rw.imageDir): true, filepath.Join(rw.imageDir, SnapshotFile): true,
		filepath.Join(rw.imageDir, premapDir): true}
	for _, t := range rw.tasks {
		if t.changed {
			rewritten[criuimg.MMPath(rw.imageDir, t.pid)] = true
			rewritten[criuimg.PagemapPath(rw.imageDir, t.pid)] = true
			rewritten[criuimg.PagesPath(rw.imageDir, t.pm.PagesID)] = true
		}
	}
	inv, err := inventorySkippingNetworkLock(rw.imageDir, rw.files)
	if err != nil {
		return err
	}
	if inv != nil {
		rewritten[criuimg.InventoryPath(rw.imageDir)] = true
	}
	if err := linkTree(rw.imageDir, rw.staging, rewritten); err != nil {
		return fmt.Errorf("staging: %w", err)
	}
	if inv != nil {
		if err := criuimg.WriteImage(criuimg.InventoryPath(rw.staging), inv); err != nil {
			return err
		}
	}
	var kept, mapped uint64
	var fdIDs map[uint32]bool
	for _, t := range rw.tasks {
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
		if err := criuimg.WriteImage(criuimg.MMPath(rw.staging, t.pid), t.mm.Image); err != nil {
			return err
		}
		pm, runs := pagemapFrom(t.pm, stay)
		if err := criuimg.WriteImage(criuimg.PagemapPath(rw.staging, t.pid), pm.Image()); err != nil {
			return err
		}
		if err := rw.writePages(criuimg.PagesPath(rw.staging, t.pm.PagesID), runs); err != nil {
			return err
		}
	}

	if rw.premapped, err = rw.writePremap(); err != nil {
		return err
	}

	// files.img: one entry for the new memory file, and no entry for a family file that
	// nothing uses any more (a rebase left it behind).
	used := map[uint32]bool{}
	for _, t := range rw.tasks {
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
	fdIDs, err = fdinfoIDs(rw.imageDir)
	if err != nil {
		return err
	}
	for id := range fdIDs {
		used[id] = true
	}
	files := &criuimg.FilesImage{Image: &criuimg.Image{Head: rw.files.Image.Head, Magic: rw.files.Image.Magic}}
	pinned := map[string]bool{}
	for _, fe := range rw.files.Entries {
		if name, ok := rw.famFiles[fe.GetId()]; ok {
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
	for _, fe := range rw.clones {
		files.Add(fe)
		if name, ok := rw.famFiles[fe.GetId()]; ok {
			pinned[name] = true
		}
	}
	if len(rw.regions) > 0 {
		pinned[rw.memName] = true
	}
	if err := criuimg.WriteImage(criuimg.FilesPath(rw.staging), files.Image); err != nil {
		return err
	}

	// What the image maps from files, for the snapshot record.
	seen := map[[2]int64]bool{}
	for _, t := range rw.tasks {
		if t.mm == nil {
			continue
		}
		for _, p := range t.vmas {
			var f *os.File
			var off int64
			switch {
			case p.convert:
				f, off = rw.mem, p.regOff
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
			n, err := rw.extents.dataPages(f, off, int64(p.pages()*pageSize))
			if err != nil {
				return err
			}
			mapped += n
		}
	}
	rw.info = SnapshotInfo{
		Family: rw.opts.Family, Pages: mapped, KeptPages: kept, MapDir: rw.opts.MapDir,
		Rebased: rw.rebase, Created: time.Now().UTC(),
	}
	for name := range pinned {
		rw.info.Files = append(rw.info.Files, name)
	}
	slices.Sort(rw.info.Files)
	// The parent is the newest file a delta sits on (names sort by time).
	for _, name := range rw.info.Files {
		if name != rw.memName {
			rw.info.Parent = name
		}
	}
	return writeJSONAtomic(filepath.Join(rw.staging, SnapshotFile), &rw.info, 0o644)
}

// writePages writes a pages image holding runs back to back.
func (rw *rewriter) writePages(path string, runs []run) error {
	f, err := os.OpenFile(path, os.O_RDWR|os.O_CREATE|os.O_EXCL, 0o644)
	if err != nil {
		return err
	}
	defer f.Close()
	before := rw.cp.written
	var off int64
	for _, r := range runs {
		n := int64(r.n * pageSize)
		if r.kind == srcFile {
			if err := rw.cp.copy(f, off, r.f, r.off, n); err != nil {
				return err
			}
		}
		off += n
	}
	rw.stagedBytes += rw.cp.written - before
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

// commit makes the rewrite visible: under the family lock, the new snapshot's
// reference is recorded, the memory file gets its final name and is sealed
// (immutable, see Seal), and the staged
// image is swapped with imageDir in one atomic rename (RENAME_EXCHANGE).
// The old image then sits at the staging path and is removed.
func (rw *rewriter) commit(ctx context.Context) error {
	unlock, err := rw.store.lockFamily(rw.opts.Family)
	if err != nil {
		return err
	}
	defer unlock()
	if rw.mem != nil {
		final := filepath.Join(rw.famDir, rw.memName)
		if err := os.Rename(rw.memTmp, final); err != nil {
			return err
		}
		rw.memTmp = final // an abort from here on removes it (removeSealed)
		// Forks map the file from now on: nobody, root included, may write,
		// truncate, rename or unlink it (16 flipped bytes would change
		// running forks, a truncation kill them with SIGBUS). Only the
		// store unseals it, to link it into a view or to free it.
		if err := setImmutable(int(rw.mem.Fd()), final, true); err != nil {
			return err
		}
	}
	if rw.opts.Stage != nil {
		if err := rw.opts.Stage(ctx, rw.staging); err != nil {
			return fmt.Errorf("stage hook: %w", err)
		}
	}
	holder := rw.opts.Holder
	if holder == "" {
		holder = HolderSnapshot + rw.imageDir
	}
	if err := rw.store.refLocked(rw.opts.Family, holder, rw.info.Files); err != nil {
		return err
	}
	// Every directory the swap touches must agree with the holder record
	// before the swap (a crash between the two leaves a dead holder, since
	// imageDir has no lazyfork.json yet, and GC frees the file).
	if err := ctx.Err(); err != nil {
		rw.store.dropRefLocked(rw.opts.Family, holder, rw.opts.Holder == "")
		return err
	}
	if err := unix.Renameat2(unix.AT_FDCWD, rw.staging, unix.AT_FDCWD, rw.imageDir, unix.RENAME_EXCHANGE); err != nil {
		rw.store.dropRefLocked(rw.opts.Family, holder, rw.opts.Holder == "")
		if errors.Is(err, unix.EINVAL) || errors.Is(err, unix.ENOSYS) {
			return fmt.Errorf("atomic swap of %s (renameat2 RENAME_EXCHANGE): %v: %w", rw.imageDir, err, errdefs.ErrNotImplemented)
		}
		return fmt.Errorf("swap %s: %w", rw.imageDir, err)
	}
	rw.memTmp = ""
	// The old image now sits at the staging path. The snapshot is in place
	// whatever happens next; a leftover is removed by the next rewrite.
	old := rw.staging
	rw.staging = ""
	os.RemoveAll(old)
	return nil
}

// dropRefLocked undoes refLocked for a holder created by a rewrite that then
// failed. A caller-supplied holder may hold other files: only a
// rewrite-made snapshot holder is removed. Preconditions: family lock held.
func (s *Store) dropRefLocked(family, holder string, ours bool) {
	if ours {
		os.Remove(s.refPath(family, holder))
	}
}

// splitCOWIDs works around CRIU's test for copy-on-write sharing between a
// parent's and a child's VMA (criu/mem.c, check_cow_vmas): same start, end
// and file id, but not the same offset. A dump of a restored copy, and the
// rewrite itself, give every mapping of one memory file the same file id, so a child whose VMA maps its
// own region at the address where its parent maps another region of that
// file would be restored with the parent's contents. Such a child VMA gets a
// file id of its own (a clone of the files.img entry).
func (rw *rewriter) splitCOWIDs(memEntry *fdinfo.FileEntry) error {
	byPID := map[uint32]*task{}
	for _, t := range rw.tasks {
		byPID[t.pid] = t
	}
	entries := map[uint32]*fdinfo.FileEntry{}
	for _, fe := range rw.files.Entries {
		entries[fe.GetId()] = fe
	}
	if memEntry != nil {
		entries[memEntry.GetId()] = memEntry
	}
	next := rw.files.MaxID() + 1
	if len(rw.regions) > 0 {
		next++ // the new memory file's entry
	}
	for _, t := range rw.tasks {
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
			clone := proto.Clone(orig).(*fdinfo.FileEntry)
			clone.Id = ptr(next)
			clone.Reg.Id = ptr(next)
			rw.clones = append(rw.clones, clone)
			if name, ok := rw.famFiles[orig.GetId()]; ok {
				rw.famFiles[next] = name
			}
			v.Shmid = ptr(uint64(next))
			next++
			t.changed = true
		}
	}
	return nil
}
