//go:build linux

package client

import (
	"bytes"
	"cmp"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"slices"
	"strings"

	"github.com/checkpoint-restore/go-criu/v7/crit/images/fdinfo"
	"github.com/checkpoint-restore/go-criu/v7/crit/images/mnt"
	"github.com/checkpoint-restore/go-criu/v7/crit/images/pagemap"
	"github.com/containerd/errdefs"
	"golang.org/x/sys/unix"
	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/proto"

	"github.com/lazyfork/lazyfork/api"
	"github.com/lazyfork/lazyfork/criuimg"
	"github.com/lazyfork/lazyfork/memfile"
)

// CRIU's VMA status bits (criu/include/image.h) that the inlining changes.
const (
	vmaAreaRegular = 1 << 0
	vmaFilePrivate = 1 << 6
	vmaFileShared  = 1 << 7
	vmaAnonPrivate = 1 << 9
)

// lazyforkImageFiles are the files a rewrite adds to a CRIU image; a
// standard image has none of them.
var lazyforkImageFiles = map[string]bool{api.SnapshotFile: true, api.SourceFile: true, "parent": true}

// inlineImage writes into dst (an empty directory) a standard CRIU image of
// the LazyFork snapshot at src: the inverse of memfile's rewrite. Every
// mapping of a memory file (a path under memfile.MountPath) becomes private
// anonymous memory again, its pages read from the family's file (famDir)
// with the snapshot's own delta on top, and written into pagemap/pages
// images as CRIU dumps them; the memory mount (the external bind at
// memfile.MountPath and the binds of files from it, the overcommit hook's)
// leaves the mount tree, so a plain `criu restore` or `runc restore` needs
// nothing of LazyFork. Zero pages of memory files are left out, as CRIU
// leaves out pages a process never touched. An image that maps no memory
// file (a plain runc dump) is copied with only LazyFork's records dropped.
func inlineImage(src, dst, famDir string) error {
	entries, err := os.ReadDir(src)
	if err != nil {
		return err
	}
	files, err := criuimg.ReadFiles(src)
	if err != nil {
		return fmt.Errorf("files image: %w", err)
	}
	// Memory files by file id, and the ids anything but a mapping uses.
	memIDs := map[uint32]string{}
	for _, e := range files.Entries {
		if e.GetType() != fdinfo.FdTypes_REG || e.GetReg() == nil {
			continue
		}
		if name, ok := strings.CutPrefix(e.GetReg().GetName(), memfile.MountPath+"/"); ok && !strings.Contains(name, "/") {
			memIDs[e.GetId()] = name
		}
	}
	pstree, err := criuimg.ReadPstree(src)
	if err != nil {
		return fmt.Errorf("pstree image: %w", err)
	}
	rewritten := map[string]bool{}
	opened := map[string]*os.File{}
	defer func() {
		for _, f := range opened {
			f.Close()
		}
	}()
	open := func(name string) (*os.File, error) {
		if f := opened[name]; f != nil {
			return f, nil
		}
		if famDir == "" {
			return nil, fmt.Errorf("the image maps memory file %s but its family is unknown: %w", name, errdefs.ErrDataLoss)
		}
		f, err := os.Open(filepath.Join(famDir, name))
		if err != nil {
			if errors.Is(err, os.ErrNotExist) {
				return nil, fmt.Errorf("memory file %s is not in %s: the snapshot's memory is gone from this host (export it where it was taken, while its memory files exist): %w",
					name, famDir, errdefs.ErrNotFound)
			}
			return nil, err
		}
		opened[name] = f
		return f, nil
	}
	usedMem := map[uint32]bool{}
	for _, p := range pstree {
		pid := p.GetPid()
		mmImg, err := criuimg.ReadMM(src, pid)
		if err != nil {
			if errdefs.IsNotFound(err) || errors.Is(err, os.ErrNotExist) {
				continue // a zombie has no mm
			}
			return fmt.Errorf("mm of pid %d: %w", pid, err)
		}
		pm, err := criuimg.ReadPagemap(src, pid)
		if err != nil {
			return fmt.Errorf("pagemap of pid %d: %w", pid, err)
		}
		_, total := pm.Offsets()
		pages, err := criuimg.OpenPages(src, pm.PagesID, total)
		if err != nil {
			return err
		}
		changed, err := inlineTask(dst, pid, mmImg, pm, pages, memIDs, usedMem, open)
		pages.Close()
		if err != nil {
			return fmt.Errorf("pid %d: %w", pid, err)
		}
		if changed {
			rewritten[filepath.Base(criuimg.MMPath(src, pid))] = true
			rewritten[filepath.Base(criuimg.PagemapPath(src, pid))] = true
			rewritten[filepath.Base(criuimg.PagesPath(src, pm.PagesID))] = true
		}
	}
	// A file descriptor on a memory file keeps its entry (and so its mount).
	fdUsed, err := fdFileIDs(src)
	if err != nil {
		return err
	}
	keepMount := false
	if len(memIDs) > 0 {
		kept := files.Entries[:0]
		for _, e := range files.Entries {
			if _, mem := memIDs[e.GetId()]; mem && !fdUsed[e.GetId()] {
				continue
			}
			if _, mem := memIDs[e.GetId()]; mem {
				keepMount = true
			}
			kept = append(kept, e)
		}
		files.Entries = kept
		img := &criuimg.Image{Head: files.Image.Head, Magic: files.Image.Magic}
		for _, e := range kept {
			img.Entries = append(img.Entries, e)
		}
		if err := criuimg.WriteImage(criuimg.FilesPath(dst), img); err != nil {
			return err
		}
		rewritten[filepath.Base(criuimg.FilesPath(src))] = true
	}
	if !keepMount {
		ms, _ := filepath.Glob(filepath.Join(src, "mountpoints-*.img"))
		for _, p := range ms {
			changed, err := stripMemMounts(p, filepath.Join(dst, filepath.Base(p)))
			if err != nil {
				return err
			}
			if changed {
				rewritten[filepath.Base(p)] = true
			}
		}
	}
	for _, e := range entries {
		name := e.Name()
		if rewritten[name] || lazyforkImageFiles[name] {
			continue
		}
		if !e.Type().IsRegular() {
			continue
		}
		if err := copyFile(filepath.Join(src, name), filepath.Join(dst, name)); err != nil {
			return err
		}
	}
	return nil
}

// inlineTask writes pid's mm, pagemap and pages into dst, every mapping of a
// memory file made anonymous memory with its pages in the image. It reports
// whether it wrote them (always, so far: every pagemap gets nr_pages).
func inlineTask(dst string, pid uint32, mmImg *criuimg.MMImage, pm *criuimg.Pagemap, pages *criuimg.Pages,
	memIDs map[uint32]string, used map[uint32]bool, open func(string) (*os.File, error)) (bool, error) {
	vmas := mmImg.MM.GetVmas()
	for _, e := range pm.Entries {
		if f := criuimg.Flags(e); f&criuimg.PEPresent == 0 && f&criuimg.PEParent != 0 {
			// memfile's premap parent is empty; a real parent image is not.
			return false, fmt.Errorf("pagemap entry at %#x has its pages in a parent image (an incremental dump): %w", e.GetVaddr(), errdefs.ErrNotImplemented)
		}
	}
	offs, _ := pm.Offsets()
	out, err := os.OpenFile(criuimg.PagesPath(dst, pm.PagesID), os.O_WRONLY|os.O_CREATE|os.O_EXCL, 0o600)
	if err != nil {
		return false, err
	}
	defer out.Close()
	w := &pageWriter{out: out}
	page := make([]byte, criuimg.PageSize)
	// The image's pages, in address order (CRIU writes them sorted).
	var img []imageRun
	for i, e := range pm.Entries {
		if offs[i] >= 0 {
			img = append(img, imageRun{e.GetVaddr(), e.GetVaddr() + uint64(e.GetNrPages())*criuimg.PageSize, offs[i]})
		}
	}
	next := 0 // first image run not yet written
	for _, v := range vmas {
		start, end := v.GetStart(), v.GetEnd()
		// Image runs below this VMA belong to no VMA: kept as they are.
		var inside []imageRun
		for next < len(img) && img[next].start < end {
			inside = append(inside, img[next])
			next++
		}
		if !isMemVMA(v.GetStatus(), v.GetShmid(), memIDs) {
			for _, r := range inside {
				if err := w.copyRun(pages, r); err != nil {
					return false, err
				}
			}
			continue
		}
		name := memIDs[uint32(v.GetShmid())]
		used[uint32(v.GetShmid())] = true
		f, err := open(name)
		if err != nil {
			return false, err
		}
		base := int64(v.GetPgoff())
		data, err := dataRanges(f, base, base+int64(end-start))
		if err != nil {
			return false, fmt.Errorf("memory file %s: %w", name, err)
		}
		// Every page that is in the image (the snapshot's delta) or in the
		// file's data, in address order; the delta wins.
		var cand [][2]uint64
		for _, r := range inside {
			cand = append(cand, [2]uint64{r.start, r.end})
		}
		for _, d := range data {
			a := start + uint64(d[0]-base)&^(criuimg.PageSize-1)
			b := start + (uint64(d[1]-base)+criuimg.PageSize-1)&^(criuimg.PageSize-1)
			cand = append(cand, [2]uint64{a, min(b, end)})
		}
		for _, c := range mergeRuns(cand) {
			for a := c[0]; a < c[1]; a += criuimg.PageSize {
				if off, ok := lookupRun(inside, a); ok {
					if _, err := pages.ReadAt(page, off); err != nil {
						return false, fmt.Errorf("pages image at %d: %w", off, err)
					}
				} else {
					off := base + int64(a-start)
					clear(page)
					if _, err := f.ReadAt(page, off); err != nil && !errors.Is(err, io.EOF) {
						return false, fmt.Errorf("memory file %s at %d: %w", name, off, err)
					}
					if allZero(page) {
						continue // zeros, as untouched anonymous memory
					}
				}
				if err := w.add(a, page); err != nil {
					return false, err
				}
			}
		}
		v.Status = proto.Uint32(v.GetStatus()&^vmaFilePrivate | vmaAnonPrivate)
		v.Flags = proto.Uint32(v.GetFlags() | unix.MAP_ANONYMOUS)
		v.Shmid = proto.Uint64(0)
		v.Pgoff = proto.Uint64(0)
		v.Fdflags = nil
		v.Fd = proto.Int64(-1)
	}
	for ; next < len(img); next++ {
		if err := w.copyRun(pages, img[next]); err != nil {
			return false, err
		}
	}
	if err := w.flush(); err != nil {
		return false, err
	}
	if err := out.Close(); err != nil {
		return false, err
	}
	for _, e := range w.entries {
		withNrPages64(e)
	}
	npm := &criuimg.Pagemap{Head: pm.Head, PagesID: pm.PagesID, HeadMsg: pm.HeadMsg, Entries: w.entries}
	if err := criuimg.WriteImage(criuimg.PagemapPath(dst, pid), npm.Image()); err != nil {
		return false, err
	}
	if err := criuimg.WriteImage(criuimg.MMPath(dst, pid), mmImg.Image); err != nil {
		return false, err
	}
	return true, nil
}

// withNrPages64 adds field 5 (nr_pages, uint64) to a pagemap entry beside
// field 2 (nr_pages, uint32), as CRIU 4.2 and later write them: their readers
// (go-criu v8, so checkpointctl) take the count from field 5 only, CRIU
// 4.1's ignore it.
func withNrPages64(e *pagemap.PagemapEntry) {
	b := protowire.AppendTag(nil, 5, protowire.VarintType)
	b = protowire.AppendVarint(b, uint64(e.GetNrPages()))
	e.ProtoReflect().SetUnknown(b)
}

// dropNrPages64 removes what withNrPages64 added from the pagemaps of an
// image: memfile's rewrite changes entries by field 2, and a newer CRIU
// would read a stale field 5.
func dropNrPages64(imageDir string) error {
	pms, _ := filepath.Glob(filepath.Join(imageDir, "pagemap-*.img"))
	for _, p := range pms {
		img, err := criuimg.ReadImage(p, criuimg.MagicPagemap, criuimg.KindOf(p).NewEntry)
		if err != nil {
			return err
		}
		changed := false
		for _, e := range img.Entries[1:] {
			pe := e.(*pagemap.PagemapEntry)
			if pe.NrPages != nil && len(pe.ProtoReflect().GetUnknown()) > 0 {
				pe.ProtoReflect().SetUnknown(nil)
				changed = true
			}
		}
		if changed {
			if err := criuimg.WriteImage(p, img); err != nil {
				return err
			}
		}
	}
	return nil
}

func isMemVMA(status uint32, shmid uint64, memIDs map[uint32]string) bool {
	if status&vmaAreaRegular == 0 || status&vmaFilePrivate == 0 || status&vmaFileShared != 0 {
		return false
	}
	_, ok := memIDs[uint32(shmid)]
	return ok
}

// pageWriter appends pages to a pages image and joins consecutive pages into
// one pagemap entry.
type pageWriter struct {
	out     *os.File
	buf     bytes.Buffer
	entries []*pagemap.PagemapEntry
	next    uint64 // address after the last page added
}

func (w *pageWriter) add(vaddr uint64, page []byte) error {
	if n := len(w.entries); n > 0 && w.next == vaddr {
		e := w.entries[n-1]
		e.NrPages = proto.Uint32(e.GetNrPages() + 1)
	} else {
		w.entries = append(w.entries, criuimg.NewPresentEntry(vaddr, 1))
	}
	w.next = vaddr + criuimg.PageSize
	w.buf.Write(page)
	if w.buf.Len() >= 1<<20 {
		return w.flush()
	}
	return nil
}

func (w *pageWriter) flush() error {
	_, err := w.out.Write(w.buf.Bytes())
	w.buf.Reset()
	return err
}

// imageRun is a run of pages in a pages image: addresses [start, end) at
// offset off.
type imageRun struct {
	start, end uint64
	off        int64
}

// lookupRun finds the offset of the page at vaddr in runs.
func lookupRun(runs []imageRun, vaddr uint64) (int64, bool) {
	for _, r := range runs {
		if vaddr >= r.start && vaddr < r.end {
			return r.off + int64(vaddr-r.start), true
		}
	}
	return 0, false
}

// mergeRuns sorts address ranges and joins those that overlap or touch.
func mergeRuns(rs [][2]uint64) [][2]uint64 {
	slices.SortFunc(rs, func(a, b [2]uint64) int { return cmp.Compare(a[0], b[0]) })
	var out [][2]uint64
	for _, r := range rs {
		if r[1] <= r[0] {
			continue
		}
		if n := len(out); n > 0 && r[0] <= out[n-1][1] {
			out[n-1][1] = max(out[n-1][1], r[1])
			continue
		}
		out = append(out, r)
	}
	return out
}

// copyRun copies a run of the old pages image as it is.
func (w *pageWriter) copyRun(pages *criuimg.Pages, r imageRun) error {
	page := make([]byte, criuimg.PageSize)
	for a, off := r.start, r.off; a < r.end; a, off = a+criuimg.PageSize, off+criuimg.PageSize {
		if _, err := pages.ReadAt(page, off); err != nil {
			return fmt.Errorf("pages image at %d: %w", off, err)
		}
		if err := w.add(a, page); err != nil {
			return err
		}
	}
	return nil
}

func allZero(b []byte) bool {
	for _, c := range b {
		if c != 0 {
			return false
		}
	}
	return true
}

// extents are the data (non-hole) ranges of a file within a window.
type extents [][2]int64

// dataRanges lists the data ranges of f in [from, to) with SEEK_DATA and
// SEEK_HOLE (tmpfs has them): a slot's holes are never read.
func dataRanges(f *os.File, from, to int64) (extents, error) {
	var x extents
	fd := int(f.Fd())
	for off := from; off < to; {
		d, err := unix.Seek(fd, off, unix.SEEK_DATA)
		if err != nil {
			if errors.Is(err, unix.ENXIO) {
				break
			}
			if errors.Is(err, unix.EINVAL) {
				return extents{{from, to}}, nil // no hole support: read it all
			}
			return nil, err
		}
		if d >= to {
			break
		}
		h, err := unix.Seek(fd, d, unix.SEEK_HOLE)
		if err != nil {
			return nil, err
		}
		x = append(x, [2]int64{d, min(h, to)})
		off = h
	}
	return x, nil
}

// fdFileIDs are the file ids open as descriptors in any task of the image.
func fdFileIDs(dir string) (map[uint32]bool, error) {
	ids := map[uint32]bool{}
	ps, _ := filepath.Glob(filepath.Join(dir, "fdinfo-*.img"))
	for _, p := range ps {
		img, err := criuimg.ReadImage(p, criuimg.MagicFdinfo, criuimg.KindOf(p).NewEntry)
		if err != nil {
			return nil, err
		}
		for _, e := range img.Entries {
			ids[e.(*fdinfo.FdinfoEntry).GetId()] = true
		}
	}
	return ids, nil
}

// stripMemMounts writes mountpoints image src to dst without the LazyFork
// memory mount (mountpoint memfile.MountPath) and every other mount of its
// filesystem (the overcommit hook's binds) or below one of them. It reports
// whether it changed anything (dst is written only then).
func stripMemMounts(src, dst string) (bool, error) {
	img, err := criuimg.ReadImage(src, criuimg.MagicMnts, criuimg.KindOf(src).NewEntry)
	if err != nil {
		return false, err
	}
	var dev uint32
	found := false
	for _, e := range img.Entries {
		m := e.(*mnt.MntEntry)
		if mountPath(m.GetMountpoint()) == memfile.MountPath {
			dev, found = m.GetRootDev(), true
		}
	}
	if !found {
		return false, nil
	}
	drop := map[uint32]bool{}
	for _, e := range img.Entries {
		m := e.(*mnt.MntEntry)
		if m.GetRootDev() == dev {
			drop[m.GetMntId()] = true
		}
	}
	for changed := true; changed; {
		changed = false
		for _, e := range img.Entries {
			m := e.(*mnt.MntEntry)
			if !drop[m.GetMntId()] && drop[m.GetParentMntId()] {
				drop[m.GetMntId()], changed = true, true
			}
		}
	}
	kept := img.Entries[:0]
	for _, e := range img.Entries {
		if !drop[e.(*mnt.MntEntry).GetMntId()] {
			kept = append(kept, e)
		}
	}
	img.Entries = kept
	return true, criuimg.WriteImage(dst, img)
}

// mountPath is a CRIU mountpoint ("./x" or "/x") as an absolute clean path.
func mountPath(p string) string {
	return "/" + strings.Trim(strings.TrimPrefix(p, "."), "/")
}

// addMemMount gives a standard image's mount tree the external bind mount
// of memfile.MountPath that every LazyFork container has (the shim binds
// the container's memory view there, and runc hands CRIU its source at
// restore), so the memory files a rewrite maps can be opened through it. An
// image that has one already, or no mount namespace of its own, is left as
// it is.
func addMemMount(imageDir string) error {
	ms, _ := filepath.Glob(filepath.Join(imageDir, "mountpoints-*.img"))
	for _, p := range ms {
		img, err := criuimg.ReadImage(p, criuimg.MagicMnts, criuimg.KindOf(p).NewEntry)
		if err != nil {
			return err
		}
		var root *mnt.MntEntry
		var maxID, maxDev uint32
		for _, e := range img.Entries {
			m := e.(*mnt.MntEntry)
			switch mountPath(m.GetMountpoint()) {
			case memfile.MountPath:
				return nil
			case "/":
				if root == nil || m.GetParentMntId() != root.GetMntId() {
					root = m
				}
			}
			maxID, maxDev = max(maxID, m.GetMntId()), max(maxDev, m.GetRootDev())
		}
		if root == nil {
			return fmt.Errorf("%s: no root mount: %w", p, errdefs.ErrDataLoss)
		}
		// What CRIU records for runc's external bind of the memory view.
		img.Entries = append(img.Entries, &mnt.MntEntry{
			Fstype:      proto.Uint32(5), // tmpfs
			MntId:       proto.Uint32(maxID + 1),
			RootDev:     proto.Uint32(maxDev + 1),
			ParentMntId: proto.Uint32(root.GetMntId()),
			Flags:       proto.Uint32(unix.MS_RDONLY | unix.MS_NOSUID | unix.MS_NODEV | unix.MS_RELATIME),
			Root:        proto.String("/"),
			Mountpoint:  proto.String(memfile.MountPath),
			Source:      proto.String("lazyfork"),
			Options:     proto.String("mode=755"),
			SharedId:    proto.Uint32(0),
			MasterId:    proto.Uint32(0),
			SbFlags:     proto.Uint32(0),
			ExtKey:      proto.String(memfile.MountPath),
		})
		if err := criuimg.WriteImage(p, img); err != nil {
			return err
		}
		return nil
	}
	return nil
}
