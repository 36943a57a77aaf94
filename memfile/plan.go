package memfile

import (
	"fmt"
	"os"
	"slices"

	"github.com/checkpoint-restore/go-criu/v7/crit/images/pagemap"
	"github.com/checkpoint-restore/go-criu/v7/crit/images/vma"
	"github.com/containerd/errdefs"
	"golang.org/x/sys/unix"

	"github.com/lazyfork/lazyfork/criuimg"
)

// VMA status bits (criu/include/image.h).
const (
	vmaAreaRegular  = 1 << 0
	vmaAreaStack    = 1 << 1
	vmaAreaVsyscall = 1 << 2
	vmaAreaVDSO     = 1 << 3
	vmaFilePrivate  = 1 << 6
	vmaFileShared   = 1 << 7
	vmaAnonShared   = 1 << 8
	vmaAnonPrivate  = 1 << 9
	vmaAreaSysVIPC  = 1 << 10
	vmaAreaSocket   = 1 << 11
	vmaAreaVVAR     = 1 << 12
	vmaAreaAIORing  = 1 << 13
	vmaAreaMemfd    = 1 << 14
	vmaAreaShstk    = 1 << 15
	vmaExtPlugin    = 1 << 27
	vmaUnsupp       = 1 << 31

	// VMAs with any of these stay exactly as they are.
	vmaSpecial = vmaAreaStack | vmaAreaVsyscall | vmaAreaVDSO | vmaAreaVVAR | vmaAreaAIORing |
		vmaAreaSysVIPC | vmaAreaSocket | vmaAreaMemfd | vmaAreaShstk | vmaExtPlugin | vmaUnsupp
)

const pageSize = criuimg.PageSize

// taskDead is CRIU's task state of a zombie (criu/include/pstree.h).
const taskDead = 2

// srcKind says where the bytes of a run of pages come from.
type srcKind int

const (
	srcFile srcKind = iota // f at off (a pages image or an old memory file)
	srcZero                // zeros
)

// run is a run of pages at consecutive addresses with consecutive sources.
type run struct {
	vaddr uint64
	n     uint64 // pages
	kind  srcKind
	f     *os.File
	off   int64
	flags uint32 // pagemap flags to keep, for runs that stay in the image
}

func (r run) end() uint64 { return r.vaddr + r.n*pageSize }

// slice returns the part of r in [from, to).
func (r run) slice(from, to uint64) run {
	from, to = max(from, r.vaddr), min(to, r.end())
	out := r
	if to <= from {
		out.vaddr, out.n = from, 0
		return out
	}
	out.vaddr = from
	out.n = (to - from) / pageSize
	if r.kind == srcFile {
		out.off = r.off + int64(from-r.vaddr)
	}
	return out
}

// appendRun appends r to runs, merging it into the last run when both
// addresses and sources continue.
func appendRun(runs []run, r run) []run {
	if r.n == 0 {
		return runs
	}
	if k := len(runs); k > 0 {
		l := &runs[k-1]
		if l.end() == r.vaddr && l.kind == r.kind && l.flags == r.flags &&
			(r.kind == srcZero || (l.f == r.f && l.off+int64(l.n*pageSize) == r.off)) {
			l.n += r.n
			return runs
		}
	}
	return append(runs, r)
}

type vmaKind int

const (
	vmaKeep     vmaKind = iota // stays as it is, its pages stay in the image
	vmaAnon                    // private anonymous with pages: moves into a memory file
	vmaFamily                  // private mapping of a family file: its pages are a delta
	vmaFileData                // dirty private writable mapping of a program's file (.data): moves into a memory file
	vmaWipe                    // private anonymous, MADV_WIPEONFORK in the live process: its pages are dropped
)

// vmaPlan is what happens to one VMA.
type vmaPlan struct {
	e       *vma.VmaEntry
	kind    vmaKind
	overlay []run // the VMA's pages in the image, clipped to it

	// base of a vmaFamily or vmaFileData VMA: the file it maps and the
	// offset of its start (baseName is a family file's name, or the path
	// under FileRoot prefixed with fileBasePrefix).
	baseName string
	base     *os.File
	baseOff  int64

	convert bool // gets a new region (vmaAnon always, vmaFamily on rebase)

	// Outcome of a conversion: the region it maps and the pages it keeps.
	region *region
	regOff int64 // byte offset of the VMA's start in the memory file
	kept   []run // pages that stay in the image (differences from the shared region)

	// patch: a vmaFamily VMA whose pages become patches (RewriteOptions.Patch);
	// pieces are the mappings it becomes (layout phase).
	patch  bool
	pieces []piece
}

// hasBase reports whether the VMA's untouched pages come from a file.
func (p *vmaPlan) hasBase() bool { return p.kind == vmaFamily || p.kind == vmaFileData }

func (p *vmaPlan) pages() uint64 { return (p.e.GetEnd() - p.e.GetStart()) / pageSize }

// region is a slot of the new memory file that one VMA owns (and that its
// children's matching VMAs may share).
type region struct {
	slot  int
	off   int64
	regID uint32 // reg-file id of this region in files.img
	owner *vmaPlan
}

// task is one process of the dumped tree.
type task struct {
	pid, ppid uint32
	mm        *criuimg.MMImage
	pm        *criuimg.Pagemap
	pages     *criuimg.Pages
	vmas      []*vmaPlan
	changed   bool
}

func convertible(v *vma.VmaEntry) bool {
	st := v.GetStatus()
	fl := v.GetFlags()
	if st&vmaAreaRegular == 0 || st&vmaAnonPrivate == 0 || st&vmaSpecial != 0 {
		return false
	}
	// The stack is recognised by MAP_GROWSDOWN (CRIU refuses a growsdown file
	// mapping; the status bits do not mark it).
	if fl&unix.MAP_GROWSDOWN != 0 || fl&unix.MAP_HUGETLB != 0 || fl&unix.MAP_ANONYMOUS == 0 || fl&unix.MAP_PRIVATE == 0 {
		return false
	}
	// MADV_WIPEONFORK is refused (EINVAL) on a file mapping: CRIU would fail
	// to restore the advice.
	if v.GetMadv()&(1<<unix.MADV_WIPEONFORK) != 0 {
		return false
	}
	return true
}

// wipeable reports whether a VMA can be restored zeroed with MADV_WIPEONFORK:
// plain private anonymous memory (the kernel refuses the advice elsewhere).
func wipeable(v *vma.VmaEntry) bool {
	st, fl := v.GetStatus(), v.GetFlags()
	return st&vmaAreaRegular != 0 && st&vmaAnonPrivate != 0 && st&vmaSpecial == 0 &&
		fl&unix.MAP_ANONYMOUS != 0 && fl&unix.MAP_PRIVATE != 0 && fl&(unix.MAP_GROWSDOWN|unix.MAP_HUGETLB) == 0
}

// fileDataCandidate reports whether a VMA is a private file mapping of the
// kind whose dirty pages can move into a memory file: a program's or
// library's .data (writable, not executable, a plain regular mapping).
// Whether its file may be read is checked separately (fileCheck.base).
func fileDataCandidate(v *vma.VmaEntry) bool {
	st, fl, prot := v.GetStatus(), v.GetFlags(), v.GetProt()
	if st&vmaAreaRegular == 0 || st&vmaFilePrivate == 0 || st&(vmaSpecial|vmaAnonPrivate|vmaAnonShared|vmaFileShared) != 0 {
		return false
	}
	if fl&(unix.MAP_GROWSDOWN|unix.MAP_HUGETLB|unix.MAP_ANONYMOUS|unix.MAP_SHARED) != 0 || fl&unix.MAP_PRIVATE == 0 {
		return false
	}
	if prot&unix.PROT_WRITE == 0 || prot&unix.PROT_EXEC != 0 {
		return false
	}
	return v.GetMadv()&(1<<unix.MADV_WIPEONFORK) == 0
}

// pageRuns turns a task's pagemap into runs over its pages image. Pages held
// elsewhere (a parent image, lazy pages) are not supported.
func pageRuns(pid uint32, pm *criuimg.Pagemap, pages *criuimg.Pages) ([]run, error) {
	offs, _ := pm.Offsets()
	var runs []run
	var last uint64
	for i, e := range pm.Entries {
		fl := criuimg.Flags(e)
		if fl&criuimg.PEPresent == 0 {
			return nil, fmt.Errorf("pid %d: pagemap entry %#x has pages outside the image (flags %#x; incremental or lazy dumps are not supported): %w",
				pid, e.GetVaddr(), fl, errdefs.ErrNotImplemented)
		}
		if e.GetVaddr()%pageSize != 0 || e.GetVaddr() < last {
			return nil, fmt.Errorf("pid %d: pagemap entry %#x out of order: %w", pid, e.GetVaddr(), errdefs.ErrDataLoss)
		}
		r := run{vaddr: e.GetVaddr(), n: uint64(e.GetNrPages()), kind: srcFile, f: pages.File, off: offs[i], flags: fl}
		last = r.end()
		runs = append(runs, r)
	}
	return runs, nil
}

// clip assigns runs to the VMAs they fall in (both sorted by address); pages
// outside every VMA mean a corrupt image.
func clip(pid uint32, vmas []*vmaPlan, runs []run) error {
	j := 0
	for _, r := range runs {
		for r.n > 0 {
			for j < len(vmas) && vmas[j].e.GetEnd() <= r.vaddr {
				j++
			}
			if j == len(vmas) || vmas[j].e.GetStart() > r.vaddr {
				return fmt.Errorf("pid %d: page %#x outside every VMA: %w", pid, r.vaddr, errdefs.ErrDataLoss)
			}
			v := vmas[j]
			part := r.slice(r.vaddr, v.e.GetEnd())
			v.overlay = appendRun(v.overlay, part)
			r = r.slice(part.end(), r.end())
		}
	}
	return nil
}

// pagemapFrom builds a pagemap image and the runs of its new pages file from
// the runs that stay in the image.
func pagemapFrom(old *criuimg.Pagemap, runs []run) (*criuimg.Pagemap, []run) {
	slices.SortFunc(runs, func(a, b run) int {
		switch {
		case a.vaddr < b.vaddr:
			return -1
		case a.vaddr > b.vaddr:
			return 1
		}
		return 0
	})
	pm := &criuimg.Pagemap{Head: old.Head, PagesID: old.PagesID, HeadMsg: old.HeadMsg}
	var merged []run
	for _, r := range runs {
		merged = appendRun(merged, r)
	}
	// One entry per address-contiguous stretch: the sources may differ,
	// the pages file is written in entry order anyway.
	var cur *pagemap.PagemapEntry
	var curEnd uint64
	for _, r := range merged {
		if cur != nil && curEnd == r.vaddr && cur.GetFlags() == r.flags && uint64(cur.GetNrPages())+r.n < 1<<31 {
			cur.NrPages = ptr(cur.GetNrPages() + uint32(r.n))
		} else {
			cur = criuimg.NewPresentEntry(r.vaddr, uint32(r.n))
			cur.Flags = ptr(r.flags)
			pm.Entries = append(pm.Entries, cur)
		}
		curEnd = r.end()
	}
	return pm, merged
}

// planned is what the plan phase decided besides each VMA's fate
// (vmaPlan.convert, task.changed): whether to rebase, and how many pages
// wipe-on-fork drops.
type planned struct {
	ratio  float64 // the rebase ratio the layout shares by
	rebase bool
	wiped  uint64
}

// planVMAs decides what happens to every VMA of d, and whether to rebase
// (phase 2): a delta larger than ratio of the pages it sits on is rebased.
func planVMAs(d *dump, ratio float64) (planned, error) {
	pl := planned{ratio: ratio}
	var delta, shared uint64
	seen := map[[3]int64]bool{}
	for _, t := range d.tasks {
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
			n, err := d.extents.dataPages(p.base, p.baseOff, int64(p.e.GetEnd()-p.e.GetStart()))
			if err != nil {
				return pl, err
			}
			shared += n
		}
	}
	// Patched deltas never rebase: the patches hold what a rebase would
	// copy the whole of.
	pl.rebase = ratio > 0 && delta > 0 && float64(delta) > ratio*float64(shared) && d.opts.Patch == nil
	for _, t := range d.tasks {
		for _, p := range t.vmas {
			switch p.kind {
			case vmaWipe:
				// CRIU applies every madvise bit it finds in the image.
				p.e.Madv = ptr(p.e.GetMadv() | 1<<unix.MADV_WIPEONFORK)
				for _, r := range p.overlay {
					pl.wiped += r.n
				}
				t.changed = true
			case vmaAnon:
				p.convert = len(p.overlay) > 0
			case vmaFileData:
				p.convert = true
			case vmaFamily:
				p.convert = pl.rebase
				p.patch = !pl.rebase && d.opts.Patch != nil && len(p.overlay) > 0
			}
			if p.convert || p.patch {
				t.changed = true
			}
		}
	}
	return pl, nil
}

func ptr[T any](v T) *T { return &v }
