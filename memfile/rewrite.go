package memfile

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"time"

	"github.com/checkpoint-restore/go-criu/v7/crit/images/fdinfo"
	"github.com/checkpoint-restore/go-criu/v7/crit/images/fown"
	"github.com/checkpoint-restore/go-criu/v7/crit/images/regfile"
	"github.com/containerd/errdefs"
	"github.com/containerd/log"
	"github.com/lazyfork/lazyfork/criuimg"
	"golang.org/x/sys/unix"
)

// SlotSize is the distance between two regions of a memory file. Each
// rewritten VMA owns one slot: its pages at the start, then holes up to the
// next slot, so an mremap growth of up to SlotSize reads zeros (a hole costs
// nothing until touched), and no two VMAs ever map adjacent file offsets, so
// the kernel can never merge a neighbour into a region (an earlier layout
// with adjacent slots let a merged VMA's growth expose its neighbour's bytes).
const SlotSize int64 = 1 << 40

// DefaultRebaseRatio: a delta larger than this share of the pages it sits on
// is rebased into fresh files.
const DefaultRebaseRatio = 0.25

// RewriteOptions tune Rewrite.
type RewriteOptions struct {
	Family string
	// MapDir is the directory recorded in the image for the files, as the
	// restored task sees it: MountPath for containers, the host family dir
	// for plain processes.
	MapDir string
	// Holder is the reference the new snapshot holds on its files
	// ("" = "snapshot:"+imageDir, which dies with imageDir/lazyfork.json).
	Holder string
	// RebaseRatio: 0 = DefaultRebaseRatio; negative = never rebase.
	RebaseRatio float64
	// Stage, if set, is called with the complete new image (lazyfork.json
	// included) in its staging directory, with the new memory file at its
	// final path and the family locked, before it is swapped in: a last
	// edit that must be atomic with the rewrite (e.g. madvguard.Apply). An
	// error aborts the rewrite and leaves imageDir unchanged.
	Stage func(ctx context.Context, stagingDir string) error
	// FileRoot is the host directory the dump's file paths are relative to
	// (the container's rootfs; "/" for plain processes on the host). When
	// set, dirty private file mappings (a program's .data) are converted
	// too: their clean pages are read from the file under FileRoot, only if
	// it is provably the file the dump mapped (see the package doc). ""
	// leaves every file mapping as it is.
	FileRoot string
	// WipeOnFork lists the ranges the dumped processes had marked
	// MADV_WIPEONFORK (ReadWipeOnFork). A private anonymous VMA inside one
	// loses its pages and gets the advice back: each copy starts it zeroed,
	// as a fork() child would. CRIU alone copies its bytes into every copy.
	WipeOnFork WipeOnFork
}

// Result describes a rewrite.
type Result struct {
	Files        []string // family files the snapshot maps (base names)
	PagesMoved   uint64   // pages moved from the image into a new memory file
	PagesKept    uint64   // pages left in the image
	BytesWritten int64    // bytes written into the new memory file
	PagesWiped   uint64   // pages dropped from wipe-on-fork VMAs (RewriteOptions.WipeOnFork)
	Rebased      bool
	Duration     time.Duration
	// NewFile is the memory file the rewrite wrote ("" if it wrote none).
	NewFile string
	// Premapped lists the tasks CRIU will premap at restore: their mappings
	// would need more than 256 open files at once otherwise (see premapDir).
	Premapped []uint32
}

// Rewrite turns the CRIU dump in imageDir into a LazyFork snapshot: every
// private anonymous VMA that holds pages (and, with FileRoot, every dirty
// .data mapping whose file checks out) becomes a private mapping of a new,
// immutable file of the family, and its pages leave the image. See the
// package documentation for the layout and the rules.
//
// It is atomic: the new image is built beside imageDir and swapped in with
// one rename; on any error (or a crash) imageDir is unchanged.
func (s *Store) Rewrite(ctx context.Context, imageDir string, opts RewriteOptions) (res *Result, retErr error) {
	start := time.Now()
	if err := checkFamily(opts.Family); err != nil {
		return nil, err
	}
	if !filepath.IsAbs(opts.MapDir) || filepath.Clean(opts.MapDir) != opts.MapDir {
		return nil, fmt.Errorf("rewrite: MapDir %q must be a clean absolute path: %w", opts.MapDir, errdefs.ErrInvalidArgument)
	}
	imageDir, err := filepath.Abs(imageDir)
	if err != nil {
		return nil, err
	}
	imageDir = filepath.Clean(imageDir)
	ratio := opts.RebaseRatio
	if ratio == 0 {
		ratio = DefaultRebaseRatio
	}
	if _, err := os.Stat(filepath.Join(imageDir, SnapshotFile)); err == nil {
		return nil, fmt.Errorf("rewrite: %s is already a LazyFork snapshot: %w", imageDir, errdefs.ErrAlreadyExists)
	}
	famDir, err := s.FamilyDir(opts.Family)
	if err != nil {
		return nil, err
	}
	removeStaleStaging(imageDir)

	rw := &rewriter{
		store: s, opts: opts, ratio: ratio, imageDir: imageDir, famDir: famDir,
		cp: newCopier(), famFiles: map[uint32]string{}, opened: map[string]*os.File{}, extents: extentCache{}, maps: map[*os.File][]byte{},
	}
	defer rw.close()
	defer func() {
		if retErr != nil {
			rw.abort()
		}
	}()
	if err := rw.load(); err != nil {
		return nil, fmt.Errorf("rewrite %s: %w", imageDir, err)
	}
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	if err := rw.plan(); err != nil {
		return nil, fmt.Errorf("rewrite %s: %w", imageDir, err)
	}
	if err := rw.writeMemory(ctx); err != nil {
		return nil, fmt.Errorf("rewrite %s: %w", imageDir, err)
	}
	if err := rw.stage(ctx); err != nil {
		return nil, fmt.Errorf("rewrite %s: %w", imageDir, err)
	}
	if err := rw.commit(ctx); err != nil {
		return nil, fmt.Errorf("rewrite %s: %w", imageDir, err)
	}
	res = &Result{
		Files: rw.info.Files, PagesMoved: rw.moved, PagesKept: rw.info.KeptPages, PagesWiped: rw.wiped,
		BytesWritten: rw.cp.written + rw.parWritten - rw.stagedBytes, Rebased: rw.rebase, Duration: time.Since(start),
		Premapped: rw.premapped,
	}
	if rw.mem != nil {
		res.NewFile = rw.memName
	}
	log.G(ctx).WithField("image", imageDir).WithField("family", opts.Family).
		WithField("moved", res.PagesMoved).WithField("kept", res.PagesKept).
		WithField("rebased", res.Rebased).WithField("duration", res.Duration).Debug("memfile: rewritten")
	return res, nil
}

type rewriter struct {
	store    *Store
	opts     RewriteOptions
	ratio    float64
	imageDir string
	famDir   string
	cp       *copier

	tasks    []*task
	files    *criuimg.FilesImage
	famFiles map[uint32]string   // reg-file id -> family file name, for files under MapDir
	opened   map[string]*os.File // family files opened for reading
	extents  extentCache         // data extents of the files read, by descriptor
	maps     map[*os.File][]byte // read-only mappings of pages images (see mapped)
	mntID    *int32
	mounts   []mountpoint // the dump's mount namespace (mountNS: it has one)
	mountNS  bool
	fc       *fileCheck // checks of files under FileRoot (nil without FileRoot)

	rebase  bool
	regions []*region
	moved   uint64
	wiped   uint64 // pages of vmaWipe VMAs, dropped

	memName string // final name of the new memory file ("" if none)
	memTmp  string // its path while written
	mem     *os.File

	clones []*fdinfo.FileEntry // files.img entries added by splitCOWIDs

	jobs       []copyJob // pages waiting to be copied into the memory file
	parWritten int64     // bytes copied by flush's workers

	staging     string
	premapped   []uint32 // tasks given an empty parent pagemap (premapDir)
	stagedBytes int64    // bytes the copier spent on staged pages images
	info        SnapshotInfo
}

func (rw *rewriter) close() {
	for _, t := range rw.tasks {
		t.pages.Close()
	}
	for _, f := range rw.opened {
		f.Close()
	}
	for _, m := range rw.maps {
		if m != nil {
			unix.Munmap(m)
		}
	}
	if rw.mem != nil {
		rw.mem.Close()
	}
	rw.fc.close()
}

// abort undoes whatever a failed rewrite made; imageDir was never touched.
func (rw *rewriter) abort() {
	if rw.memTmp != "" {
		removeSealed(rw.memTmp) // sealed once commit named it
	}
	if rw.staging != "" {
		os.RemoveAll(rw.staging)
	}
}

// load reads the images the rewrite needs and validates them.
func (rw *rewriter) load() error {
	if _, err := criuimg.ReadInventory(rw.imageDir); err != nil {
		return err
	}
	tree, err := criuimg.ReadPstree(rw.imageDir)
	if err != nil {
		return err
	}
	if rw.files, err = criuimg.ReadFiles(rw.imageDir); err != nil {
		return err
	}
	prefix := rw.opts.MapDir + "/"
	for _, fe := range rw.files.Entries {
		if fe.GetType() != fdinfo.FdTypes_REG || fe.GetReg() == nil {
			continue
		}
		name, ok := strings.CutPrefix(fe.GetReg().GetName(), prefix)
		if !ok {
			// A file of another family would not be pinned by this snapshot.
			if other, ok := strings.CutPrefix(fe.GetReg().GetName(), rw.store.root+"/"); ok && !strings.HasPrefix(other, ".") {
				return fmt.Errorf("image maps %s, a file of another family than %s: %w", fe.GetReg().GetName(), rw.opts.Family, errdefs.ErrFailedPrecondition)
			}
			continue
		}
		if checkFileName(name) != nil {
			return fmt.Errorf("image maps %s under the family directory, which is not a memory file: %w", fe.GetReg().GetName(), errdefs.ErrFailedPrecondition)
		}
		f, err := rw.openFamilyFile(name)
		if err != nil {
			return err
		}
		st, err := f.Stat()
		if err != nil {
			return err
		}
		if fe.GetReg().Size != nil && fe.GetReg().GetSize() != uint64(st.Size()) {
			return fmt.Errorf("image records %s with size %d, family file has %d: %w", name, fe.GetReg().GetSize(), st.Size(), errdefs.ErrFailedPrecondition)
		}
		rw.famFiles[fe.GetId()] = name
	}
	if rw.mounts, rw.mountNS, err = readMountpoints(rw.imageDir); err != nil {
		return err
	}
	rw.findMountID()
	if rw.opts.FileRoot != "" {
		if err := rw.initFileCheck(); err != nil {
			return err
		}
	}
	for _, pe := range tree {
		pid := pe.GetPid()
		t := &task{pid: pid, ppid: pe.GetPpid()}
		rw.tasks = append(rw.tasks, t)
		if t.mm, err = criuimg.ReadMM(rw.imageDir, pid); err != nil {
			if errors.Is(err, errdefs.ErrNotFound) {
				// Only a zombie (CRIU's TASK_DEAD) has no memory image.
				if core, cerr := criuimg.ReadCore(rw.imageDir, pid); cerr == nil && core.GetTc().GetTaskState() == taskDead {
					t.mm = nil
					continue
				}
			}
			return err
		}
		if t.pm, err = criuimg.ReadPagemap(rw.imageDir, pid); err != nil {
			return err
		}
		_, total := t.pm.Offsets()
		if t.pages, err = criuimg.OpenPages(rw.imageDir, t.pm.PagesID, total); err != nil {
			return err
		}
		runs, err := pageRuns(pid, t.pm, t.pages)
		if err != nil {
			return err
		}
		var last uint64
		for _, v := range t.mm.MM.GetVmas() {
			if v.GetStart() < last || v.GetEnd() <= v.GetStart() || v.GetStart()%pageSize != 0 || v.GetEnd()%pageSize != 0 {
				return fmt.Errorf("pid %d: bad VMA %#x-%#x: %w", pid, v.GetStart(), v.GetEnd(), errdefs.ErrDataLoss)
			}
			last = v.GetEnd()
			p := &vmaPlan{e: v}
			switch {
			case wipeable(v) && rw.opts.WipeOnFork.covers(pid, v.GetStart(), v.GetEnd()):
				p.kind = vmaWipe
			case convertible(v):
				p.kind = vmaAnon
			case v.GetStatus()&vmaFilePrivate != 0 && rw.famFiles[uint32(v.GetShmid())] != "" && v.GetStatus()&vmaSpecial == 0:
				p.kind = vmaFamily
				p.baseName = rw.famFiles[uint32(v.GetShmid())]
				p.base = rw.opened[p.baseName]
				p.baseOff = int64(v.GetPgoff())
			}
			t.vmas = append(t.vmas, p)
		}
		if err := clip(pid, t.vmas, runs); err != nil {
			return err
		}
		if rw.fc != nil {
			rw.planFileData(t)
		}
	}
	return nil
}

// planFileData marks the .data VMAs of t that can move into a memory file:
// those with dumped (dirty) pages whose file checks out. A clean one stays
// a mapping of its file: converting it would cost a slot and gain nothing.
//
// Only files the task also maps executable qualify: a program or library it
// runs. A data file mapped privately is left alone, since its clean pages
// follow the file (the process may change it with write() and read it back
// through the mapping), which a frozen copy would not.
func (rw *rewriter) planFileData(t *task) {
	exec := map[string]bool{}
	for _, p := range t.vmas {
		if p.e.GetStatus()&vmaFilePrivate != 0 && p.e.GetProt()&unix.PROT_EXEC != 0 {
			if fe := rw.fc.entries[uint32(p.e.GetShmid())]; fe.GetReg() != nil {
				exec[fe.GetReg().GetName()] = true
			}
		}
	}
	for _, p := range t.vmas {
		if p.kind != vmaKeep || len(p.overlay) == 0 || !fileDataCandidate(p.e) {
			continue
		}
		b := rw.fc.base(uint32(p.e.GetShmid()))
		reason := b.reason
		if reason == "" && !exec[b.path] {
			reason = "the task does not run this file (no executable mapping of it)"
		}
		// A page past the end of the file raises SIGBUS in the original;
		// the slot would read zeros there.
		if reason == "" && int64(p.e.GetPgoff())+int64(p.pages()*pageSize) > (b.size+pageSize-1)/pageSize*pageSize {
			reason = "VMA reaches past the end of the file"
		}
		if reason != "" {
			log.L.WithField("pid", t.pid).WithField("file", b.path).WithField("vma", fmt.Sprintf("%#x", p.e.GetStart())).
				Debugf("memfile: .data mapping stays a file mapping: %s", reason)
			continue
		}
		p.kind = vmaFileData
		p.baseName = fileBasePrefix + b.path
		p.base = b.f
		p.baseOff = int64(p.e.GetPgoff())
	}
}

func (rw *rewriter) openFamilyFile(name string) (*os.File, error) {
	if f := rw.opened[name]; f != nil {
		return f, nil
	}
	f, err := os.Open(filepath.Join(rw.famDir, name))
	if err != nil {
		if errors.Is(err, os.ErrNotExist) {
			return nil, fmt.Errorf("image maps %s, missing from family %s: %w", name, rw.opts.Family, errdefs.ErrFailedPrecondition)
		}
		return nil, err
	}
	rw.opened[name] = f
	return f, nil
}

// findMountID finds the mount that holds MapDir in a dump that has its own
// mount namespace (a container): CRIU opens a file relative to the root of
// the mount its mnt_id names. Plain processes have no mountpoints image and
// their files carry no mnt_id.
func (rw *rewriter) findMountID() {
	best := -1
	for _, m := range rw.mounts {
		if m.path != "/" && rw.opts.MapDir != m.path && !strings.HasPrefix(rw.opts.MapDir, m.path+"/") {
			continue
		}
		if len(m.path) > best {
			best = len(m.path)
			rw.mntID = ptr(m.id)
		}
	}
}

// mountpoint is a mount of the dump's mount namespace.
type mountpoint struct {
	path string // absolute, clean
	id   int32
}

// readMountpoints reads the dump's mountpoints images; ok is false when it
// has none (a plain process tree, in the host's mount namespace).
func readMountpoints(imageDir string) (mounts []mountpoint, ok bool, err error) {
	ms, _ := filepath.Glob(filepath.Join(imageDir, "mountpoints-*.img"))
	for _, p := range ms {
		img, err := criuimg.ReadImage(p, criuimg.MagicMnts, criuimg.KindOf(p).NewEntry)
		if err != nil {
			return nil, false, err
		}
		for _, e := range img.Entries {
			m := e.(interface {
				GetMountpoint() string
				GetMntId() uint32
			})
			mounts = append(mounts, mountpoint{
				path: "/" + strings.Trim(strings.TrimPrefix(m.GetMountpoint(), "."), "/"),
				id:   int32(m.GetMntId()),
			})
		}
	}
	return mounts, len(ms) > 0, nil
}

// plan decides what happens to every VMA, and whether to rebase.
func (rw *rewriter) plan() error {
	var delta, shared uint64
	seen := map[[3]int64]bool{}
	for _, t := range rw.tasks {
		for _, p := range t.vmas {
			if p.kind != vmaFamily {
				continue
			}
			for _, r := range p.overlay {
				delta += r.n
			}
			k := [3]int64{int64(p.e.GetShmid()), p.baseOff, int64(p.e.GetEnd() - p.e.GetStart())}
			if seen[k] {
				continue
			}
			seen[k] = true
			n, err := rw.extents.dataPages(p.base, p.baseOff, int64(p.e.GetEnd()-p.e.GetStart()))
			if err != nil {
				return err
			}
			shared += n
		}
	}
	rw.rebase = rw.ratio > 0 && delta > 0 && float64(delta) > rw.ratio*float64(shared)
	for _, t := range rw.tasks {
		for _, p := range t.vmas {
			switch p.kind {
			case vmaWipe:
				// CRIU applies every madvise bit it finds in the image.
				p.e.Madv = ptr(p.e.GetMadv() | 1<<unix.MADV_WIPEONFORK)
				for _, r := range p.overlay {
					rw.wiped += r.n
				}
				t.changed = true
			case vmaAnon:
				p.convert = len(p.overlay) > 0
			case vmaFileData:
				p.convert = true
			case vmaFamily:
				p.convert = rw.rebase
			}
			if p.convert {
				t.changed = true
			}
		}
	}
	return nil
}

// writeMemory writes the new memory file: for each task, parents first, each
// converted VMA either shares its parent's region (keeping only the pages that
// differ) or gets a region of its own.
func (rw *rewriter) writeMemory(ctx context.Context) error {
	need := false
	for _, t := range rw.tasks {
		need = need || t.changed
	}
	if !need {
		return nil
	}
	rw.memName = fmt.Sprintf("%s-%s%s", time.Now().UTC().Format("20060102T150405"), randHex(6), FileExt)
	rw.memTmp = filepath.Join(rw.famDir, tmpPrefix+rw.memName)
	// The flock tells GC the file is being written (a dead writer's file is
	// removed). It is taken under the family lock, which GC holds while it
	// looks: GC never sees the file before it is locked.
	unlock, err := rw.store.lockFamily(rw.opts.Family)
	if err != nil {
		return err
	}
	f, err := os.OpenFile(rw.memTmp, os.O_RDWR|os.O_CREATE|os.O_EXCL, 0o400)
	if err == nil {
		rw.mem = f
		err = unix.Flock(int(f.Fd()), unix.LOCK_EX)
	}
	unlock()
	if err != nil {
		return err
	}
	byPID := map[uint32]*task{}
	for _, t := range rw.tasks {
		byPID[t.pid] = t
	}
	regBase := rw.files.MaxID() + 1
	for _, t := range rw.tasks {
		if err := ctx.Err(); err != nil {
			return err
		}
		parent := byPID[t.ppid]
		for _, p := range t.vmas {
			if !p.convert {
				continue
			}
			if parent != nil && parent.mm != nil {
				if pp := matchParent(parent, p); pp != nil {
					ok, err := rw.tryShare(p, pp)
					if err != nil {
						return err
					}
					if ok {
						continue
					}
				}
			}
			// Every region shares one files.img entry: CRIU then opens the
			// file once for a run of converted VMAs (see premapDir).
			reg := &region{slot: len(rw.regions), off: int64(len(rw.regions)) * SlotSize, regID: regBase, owner: p}
			rw.regions = append(rw.regions, reg)
			p.region, p.regOff = reg, reg.off
			if p.hasBase() {
				// The base's bytes, except where the VMA's own pages go.
				from := p.e.GetStart()
				for _, gap := range append(slices.Clone(p.overlay), run{vaddr: p.e.GetEnd()}) {
					if gap.vaddr > from {
						d := int64(from - p.e.GetStart())
						if err := rw.cp.copyData(rw.mem, reg.off+d, p.base, p.baseOff+d, int64(gap.vaddr-from)); err != nil {
							return err
						}
					}
					from = max(from, gap.end())
				}
			}
			for _, r := range p.overlay {
				rw.jobs = append(rw.jobs, copyJob{doff: reg.off + int64(r.vaddr-p.e.GetStart()), src: r.f, soff: r.off, n: int64(r.n * pageSize)})
				rw.moved += r.n
			}
		}
		// Children compare against these regions: write them now.
		if err := rw.flush(); err != nil {
			return err
		}
	}
	if err := rw.fc.recheck(); err != nil {
		return err
	}
	size := int64(len(rw.regions)) * SlotSize
	if err := f.Truncate(size); err != nil {
		return err
	}
	if err := f.Chmod(0o400); err != nil {
		return err
	}
	if tmpfs, _ := IsTmpfs(rw.famDir); !tmpfs {
		if err := f.Sync(); err != nil {
			return err
		}
	}
	return nil
}

// matchParent finds the parent's converted VMA that p can share: same end
// (growth past the end must read zeros), covering p's start, and the same
// base (both anonymous, or the same family file at the same offsets).
func matchParent(parent *task, p *vmaPlan) *vmaPlan {
	for _, pp := range parent.vmas {
		if pp.e.GetEnd() != p.e.GetEnd() || pp.e.GetStart() > p.e.GetStart() || !pp.convert || pp.region == nil {
			continue
		}
		if pp.kind != p.kind {
			return nil
		}
		if p.hasBase() && (pp.baseName != p.baseName || pp.baseOff+int64(p.e.GetStart()-pp.e.GetStart()) != p.baseOff) {
			return nil
		}
		return pp
	}
	return nil
}

// tryShare compares p's contents with pp's region at the same addresses.
// When few pages differ, p shares the region and keeps those pages in the
// image.
//
// The comparison is with the region itself, not with pp's view of it (region
// plus pp's kept pages): when CRIU lets p inherit pp's VMA, it drops (with
// MADV_DONTNEED, which brings back the file's bytes) every page pp restored
// that p's pagemap lacks, and shares by comparison every page both have. So p
// must list exactly the pages where it differs from the file.
func (rw *rewriter) tryShare(p, pp *vmaPlan) (bool, error) {
	shift := int64(p.e.GetStart() - pp.e.GetStart())
	regOff := pp.regOff + shift
	n := p.pages()
	// Pages that may differ: p's own pages, pp's kept pages, and the
	// region's data (where p sees its base instead).
	check := make([]bool, n)
	mark := func(runs []run) {
		for _, r := range runs {
			r = r.slice(p.e.GetStart(), p.e.GetEnd())
			if r.n == 0 || r.vaddr < p.e.GetStart() {
				continue
			}
			for i := uint64(0); i < r.n; i++ {
				check[(r.vaddr-p.e.GetStart())/pageSize+i] = true
			}
		}
	}
	mark(p.overlay)
	mark(pp.kept)
	if err := markData(rw.mem, regOff, n, check); err != nil {
		return false, err
	}
	var total uint64
	for _, c := range check {
		if c {
			total++
		}
	}
	limit := rw.ratio * float64(total)
	var kept []run
	var checked, differ uint64
	const stretch = 256 // pages compared per read
	a, b := make([]byte, stretch*pageSize), make([]byte, stretch*pageSize)
	for i := uint64(0); i < n; {
		if !check[i] {
			i++
			continue
		}
		j := i + 1
		for j < n && j-i < stretch && check[j] {
			j++
		}
		va := p.e.GetStart() + i*pageSize
		sz := (j - i) * pageSize
		mineBuf := rw.mapped(p, va, sz)
		if mineBuf == nil {
			mineBuf = a[:sz]
			if err := fillRange(p, nil, 0, va, mineBuf); err != nil {
				return false, err
			}
		}
		// The region holds its owner's pages at the owner's addresses: an
		// anonymous owner's pages can be read from its pages image directly.
		theirs := []byte(nil)
		if owner := pp.region.owner; owner.kind == vmaAnon {
			theirs = rw.mapped(owner, va, sz)
		}
		if theirs == nil {
			theirs = b[:sz]
			if err := fillRange(pp, rw.mem, pp.regOff, va, theirs); err != nil {
				return false, err
			}
		}
		for k := uint64(0); k < j-i; k++ {
			checked++
			if bytes.Equal(mineBuf[k*pageSize:(k+1)*pageSize], theirs[k*pageSize:(k+1)*pageSize]) {
				continue
			}
			differ++
			if float64(differ) > limit {
				return false, nil // too different: p gets its own slot
			}
			kept = appendRun(kept, sourceOf(p, va+k*pageSize))
		}
		i = j
	}
	if differ > 0 && float64(differ) > rw.ratio*float64(checked) {
		return false, nil
	}
	p.region, p.regOff, p.kept = pp.region, regOff, kept
	return true, nil
}

// mapped returns p's own pages for [va, va+sz) straight from a mapping of
// its pages image when one run holds them all (saves a copy per compared
// page), or nil.
func (rw *rewriter) mapped(p *vmaPlan, va, sz uint64) []byte {
	i, found := runAt(p.overlay, va)
	if !found {
		return nil
	}
	r := p.overlay[i]
	if r.kind != srcFile || r.end() < va+sz {
		return nil
	}
	m, ok := rw.maps[r.f]
	if !ok {
		m = nil
		if st, err := r.f.Stat(); err == nil && st.Size() > 0 {
			if b, err := unix.Mmap(int(r.f.Fd()), 0, int(st.Size()), unix.PROT_READ, unix.MAP_SHARED); err == nil {
				m = b
			}
		}
		rw.maps[r.f] = m
	}
	off := r.off + int64(va-r.vaddr)
	if m == nil || off+int64(sz) > int64(len(m)) {
		return nil
	}
	return m[off : off+int64(sz)]
}

// markData marks the pages of mem's [off, off+n pages) that hold data.
func markData(mem *os.File, off int64, n uint64, check []bool) error {
	end := off + int64(n*pageSize)
	pos := off
	for pos < end {
		data, err := unix.Seek(int(mem.Fd()), pos, unix.SEEK_DATA)
		if err != nil {
			if errors.Is(err, unix.ENXIO) {
				return nil
			}
			return err
		}
		if data >= end {
			return nil
		}
		hole, err := unix.Seek(int(mem.Fd()), data, unix.SEEK_HOLE)
		if err != nil {
			return err
		}
		hole = min(hole, end)
		for q := (data - off) / pageSize; q < (hole-off+pageSize-1)/pageSize; q++ {
			check[q] = true
		}
		pos = hole
	}
	return nil
}

// runAt finds the run of runs (sorted, disjoint) that holds address va.
func runAt(runs []run, va uint64) (int, bool) {
	return slices.BinarySearchFunc(runs, va, func(r run, va uint64) int {
		switch {
		case r.end() <= va:
			return -1
		case r.vaddr > va:
			return 1
		}
		return 0
	})
}

// sourceOf returns where the page of VMA p at address va comes from: its
// own page in the image, else its base (the family file it maps, or zeros).
func sourceOf(p *vmaPlan, va uint64) run {
	i, found := runAt(p.overlay, va)
	var src run
	switch {
	case found:
		src = p.overlay[i].slice(va, va+pageSize)
	case p.hasBase():
		src = run{vaddr: va, n: 1, kind: srcFile, f: p.base, off: p.baseOff + int64(va-p.e.GetStart())}
	default:
		src = run{vaddr: va, n: 1, kind: srcZero}
	}
	src.flags = criuimg.PEPresent
	return src
}

// fillRange fills buf with what VMA p shows from address va on: its region
// alone (mem at regOff, when it maps one), or its base with its own pages on
// top.
func fillRange(p *vmaPlan, mem *os.File, regOff int64, va uint64, buf []byte) error {
	over := p.overlay
	var base *os.File
	var baseOff int64
	switch {
	case mem != nil:
		over, base, baseOff = nil, mem, regOff+int64(va-p.e.GetStart())
	case p.hasBase():
		base, baseOff = p.base, p.baseOff+int64(va-p.e.GetStart())
	}
	if err := readFull(base, baseOff, buf); err != nil {
		return err
	}
	end := va + uint64(len(buf))
	i, _ := slices.BinarySearchFunc(over, va, func(r run, va uint64) int {
		if r.end() <= va {
			return -1
		}
		return 1
	})
	for ; i < len(over) && over[i].vaddr < end; i++ {
		r := over[i].slice(va, end)
		if r.n == 0 {
			continue
		}
		dst := buf[r.vaddr-va : r.vaddr-va+r.n*pageSize]
		if r.kind == srcZero {
			clear(dst)
			continue
		}
		if err := readFull(r.f, r.off, dst); err != nil {
			return err
		}
	}
	return nil
}

// readFull reads len(buf) bytes at off; past the end of the file (a hole)
// reads zeros; a nil file is all zeros.
func readFull(f *os.File, off int64, buf []byte) error {
	if f == nil {
		clear(buf)
		return nil
	}
	m, err := f.ReadAt(buf, off)
	if err != nil && !errors.Is(err, io.EOF) {
		return err
	}
	clear(buf[m:])
	return nil
}

func randHex(n int) string {
	b := make([]byte, n)
	rand.Read(b)
	return hex.EncodeToString(b)
}

// regFile builds the files.img entry for a region of the new memory file.
func (rw *rewriter) regFile(id uint32, st os.FileInfo, mode uint32) *fdinfo.FileEntry {
	zero := ptr(uint32(0))
	reg := &regfile.RegFileEntry{
		Id:    ptr(id),
		Flags: ptr(uint32(unix.O_RDONLY | unix.O_LARGEFILE)),
		Pos:   ptr(uint64(0)),
		Fown:  &fown.FownEntry{Uid: zero, Euid: zero, Signum: zero, PidType: zero, Pid: zero},
		Name:  ptr(rw.opts.MapDir + "/" + rw.memName),
		Size:  ptr(uint64(st.Size())),
		Mode:  ptr(mode),
	}
	if rw.mntID != nil {
		reg.MntId = rw.mntID
	}
	return &fdinfo.FileEntry{Type: fdinfo.FdTypes_REG.Enum(), Id: ptr(id), Reg: reg}
}
