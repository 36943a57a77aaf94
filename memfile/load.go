package memfile

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"

	"github.com/checkpoint-restore/go-criu/v7/crit/images/fdinfo"
	"github.com/containerd/errdefs"
	"github.com/containerd/log"
	"golang.org/x/sys/unix"

	"github.com/lazyfork/lazyfork/criuimg"
)

// dump is what the rewrite's first phase reads from a CRIU image directory:
// the process tree with every VMA classified and its pages assigned
// (vmaPlan.kind, vmaPlan.overlay), the files image, and the files the later
// phases read (family files, pages images, files under FileRoot). It owns
// those open files: close releases them. Later phases only fill in the
// vmaPlans' outcome fields.
type dump struct {
	dir       string // the image directory, absolute and clean
	storeRoot string // the store's root: files under it belong to a family
	famDir    string // the family's directory
	opts      RewriteOptions

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
}

// loadDump reads and validates the dump in dir for a rewrite into famDir
// (phase 1 of the rewrite). On error nothing is left open.
func loadDump(dir, storeRoot, famDir string, opts RewriteOptions) (*dump, error) {
	d := &dump{dir: dir, storeRoot: storeRoot, famDir: famDir, opts: opts,
		famFiles: map[uint32]string{}, opened: map[string]*os.File{}, extents: extentCache{}, maps: map[*os.File][]byte{}}
	if err := d.load(); err != nil {
		d.close()
		return nil, err
	}
	return d, nil
}

func (d *dump) close() {
	for _, t := range d.tasks {
		if t.pages != nil {
			t.pages.Close()
		}
	}
	for _, f := range d.opened {
		f.Close()
	}
	for _, m := range d.maps {
		if m != nil {
			unix.Munmap(m)
		}
	}
	d.fc.close()
}

// load reads the images the rewrite needs and validates them.
func (d *dump) load() error {
	if _, err := criuimg.ReadInventory(d.dir); err != nil {
		return err
	}
	tree, err := criuimg.ReadPstree(d.dir)
	if err != nil {
		return err
	}
	if d.files, err = criuimg.ReadFiles(d.dir); err != nil {
		return err
	}
	prefix := d.opts.MapDir + "/"
	for _, fe := range d.files.Entries {
		if fe.GetType() != fdinfo.FdTypes_REG || fe.GetReg() == nil {
			continue
		}
		name, ok := strings.CutPrefix(fe.GetReg().GetName(), prefix)
		if !ok {
			// A file of another family would not be pinned by this snapshot.
			if other, ok := strings.CutPrefix(fe.GetReg().GetName(), d.storeRoot+"/"); ok && !strings.HasPrefix(other, ".") {
				return fmt.Errorf("image maps %s, a file of another family than %s: %w", fe.GetReg().GetName(), d.opts.Family, errdefs.ErrFailedPrecondition)
			}
			continue
		}
		if checkFileName(name) != nil {
			return fmt.Errorf("image maps %s under the family directory, which is not a memory file: %w", fe.GetReg().GetName(), errdefs.ErrFailedPrecondition)
		}
		f, err := d.openFamilyFile(name)
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
		d.famFiles[fe.GetId()] = name
	}
	if d.mounts, d.mountNS, err = readMountpoints(d.dir); err != nil {
		return err
	}
	d.findMountID()
	if d.opts.FileRoot != "" {
		if err := d.initFileCheck(); err != nil {
			return err
		}
	}
	for _, pe := range tree {
		pid := pe.GetPid()
		t := &task{pid: pid, ppid: pe.GetPpid()}
		d.tasks = append(d.tasks, t)
		if t.mm, err = criuimg.ReadMM(d.dir, pid); err != nil {
			if errors.Is(err, errdefs.ErrNotFound) {
				// Only a zombie (CRIU's TASK_DEAD) has no memory image.
				if core, cerr := criuimg.ReadCore(d.dir, pid); cerr == nil && core.GetTc().GetTaskState() == taskDead {
					t.mm = nil
					continue
				}
			}
			return err
		}
		if t.pm, err = criuimg.ReadPagemap(d.dir, pid); err != nil {
			return err
		}
		_, total := t.pm.Offsets()
		if t.pages, err = criuimg.OpenPages(d.dir, t.pm.PagesID, total); err != nil {
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
			case wipeable(v) && d.opts.WipeOnFork.covers(pid, v.GetStart(), v.GetEnd()):
				p.kind = vmaWipe
			case convertible(v):
				p.kind = vmaAnon
			case v.GetStatus()&vmaFilePrivate != 0 && d.famFiles[uint32(v.GetShmid())] != "" && v.GetStatus()&vmaSpecial == 0:
				p.kind = vmaFamily
				p.baseName = d.famFiles[uint32(v.GetShmid())]
				p.base = d.opened[p.baseName]
				p.baseOff = int64(v.GetPgoff())
			}
			t.vmas = append(t.vmas, p)
		}
		if err := clip(pid, t.vmas, runs); err != nil {
			return err
		}
		if d.fc != nil {
			d.planFileData(t)
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
func (d *dump) planFileData(t *task) {
	exec := map[string]bool{}
	for _, p := range t.vmas {
		if p.e.GetStatus()&vmaFilePrivate != 0 && p.e.GetProt()&unix.PROT_EXEC != 0 {
			if fe := d.fc.entries[uint32(p.e.GetShmid())]; fe.GetReg() != nil {
				exec[fe.GetReg().GetName()] = true
			}
		}
	}
	for _, p := range t.vmas {
		if p.kind != vmaKeep || len(p.overlay) == 0 || !fileDataCandidate(p.e) {
			continue
		}
		b := d.fc.base(uint32(p.e.GetShmid()))
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

func (d *dump) openFamilyFile(name string) (*os.File, error) {
	if f := d.opened[name]; f != nil {
		return f, nil
	}
	f, err := os.Open(filepath.Join(d.famDir, name))
	if err != nil {
		if errors.Is(err, os.ErrNotExist) {
			return nil, fmt.Errorf("image maps %s, missing from family %s: %w", name, d.opts.Family, errdefs.ErrFailedPrecondition)
		}
		return nil, err
	}
	d.opened[name] = f
	return f, nil
}

// findMountID finds the mount that holds MapDir in a dump that has its own
// mount namespace (a container): CRIU opens a file relative to the root of
// the mount its mnt_id names. Plain processes have no mountpoints image and
// their files carry no mnt_id.
func (d *dump) findMountID() {
	best := -1
	for _, m := range d.mounts {
		if m.path != "/" && d.opts.MapDir != m.path && !strings.HasPrefix(d.opts.MapDir, m.path+"/") {
			continue
		}
		if len(m.path) > best {
			best = len(m.path)
			d.mntID = ptr(m.id)
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

// mapped returns p's own pages for [va, va+sz) straight from a mapping of
// its pages image when one run holds them all (saves a copy per compared
// page), or nil.
func (d *dump) mapped(p *vmaPlan, va, sz uint64) []byte {
	i, found := runAt(p.overlay, va)
	if !found {
		return nil
	}
	r := p.overlay[i]
	if r.kind != srcFile || r.end() < va+sz {
		return nil
	}
	m, ok := d.maps[r.f]
	if !ok {
		m = nil
		if st, err := r.f.Stat(); err == nil && st.Size() > 0 {
			if b, err := unix.Mmap(int(r.f.Fd()), 0, int(st.Size()), unix.PROT_READ, unix.MAP_SHARED); err == nil {
				m = b
			}
		}
		d.maps[r.f] = m
	}
	off := r.off + int64(va-r.vaddr)
	if m == nil || off+int64(sz) > int64(len(m)) {
		return nil
	}
	return m[off : off+int64(sz)]
}
