package memfile

import (
	"bytes"
	"context"
	"errors"
	"io"
	"os"
	"slices"

	"golang.org/x/sys/unix"

	"github.com/lazyfork/lazyfork/criuimg"
)

// memFile is what the layout-and-copy phase produced: the new memory file
// (complete, 0400, still under its flocked .tmp- name, nil if no VMA is
// converted), its regions, and what went into it. Each converted vmaPlan
// now names its region and the pages it keeps in the image.
type memFile struct {
	file    *PendingFile
	regions []*region
	moved   uint64 // pages moved out of the image
	reused  uint64 // of those, pages a previous snapshot's patch holds (not written)
	private uint64 // of those, the process's own: anonymous VMAs' and patched pages (not .data)
	written int64  // bytes copied into the file
}

// name is the file's final base name ("" if there is no file).
func (m *memFile) name() string {
	if m.file == nil {
		return ""
	}
	return m.file.name
}

// abort removes a file that commit did not make part of a snapshot.
func (m *memFile) abort() {
	if m.file != nil {
		m.file.Abort()
	}
}

// layout lays the converted VMAs out in the new memory file and copies their
// pages in.
type layout struct {
	d     *dump
	ratio float64
	mf    *memFile
	mem   *os.File // mf.file's descriptor
	cp    *copier
	jobs  []copyJob // pages waiting to be copied into the memory file
	// patchCopies are the new patches' bytes (patch.go), copied last,
	// maybe by PatchOptions.Copy.
	patchCopies []copyJob
}

// writeMemory writes the new memory file (phase 3): for each task, parents
// first, each converted VMA either shares its parent's region (keeping only
// the pages that differ) or gets a region of its own.
func writeMemory(ctx context.Context, s *Store, d *dump, pl planned) (mf *memFile, err error) {
	mf = &memFile{}
	need := false
	for _, t := range d.tasks {
		need = need || t.changed
	}
	if !need {
		return mf, nil
	}
	// The flock tells GC the file is being written (a dead writer's file is
	// removed).
	if mf.file, err = s.CreateFile(d.opts.Family); err != nil {
		return nil, err
	}
	l := &layout{d: d, ratio: pl.ratio, mf: mf, mem: mf.file.f, cp: newCopier()}
	if err := l.write(ctx); err != nil {
		mf.abort()
		return nil, err
	}
	mf.written += l.cp.written
	if len(mf.regions) == 0 {
		// Patches of the previous snapshot held every written page.
		mf.abort()
		mf.file = nil
	}
	return mf, nil
}

func (l *layout) write(ctx context.Context) error {
	d, f := l.d, l.mem
	byPID := map[uint32]*task{}
	for _, t := range d.tasks {
		byPID[t.pid] = t
	}
	regBase := d.files.MaxID() + 1
	for _, t := range d.tasks {
		if err := ctx.Err(); err != nil {
			return err
		}
		parent := byPID[t.ppid]
		for _, p := range t.vmas {
			if p.patch {
				if err := l.patch(t, p, regBase); err != nil {
					return err
				}
				continue
			}
			if !p.convert {
				continue
			}
			if parent != nil && parent.mm != nil {
				if pp := matchParent(parent, p); pp != nil {
					ok, err := l.tryShare(p, pp)
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
			reg := &region{slot: len(l.mf.regions), off: int64(len(l.mf.regions)) * SlotSize, regID: regBase, owner: p}
			l.mf.regions = append(l.mf.regions, reg)
			p.region, p.regOff = reg, reg.off
			if p.hasBase() {
				// The base's bytes, except where the VMA's own pages go.
				from := p.e.GetStart()
				for _, gap := range append(slices.Clone(p.overlay), run{vaddr: p.e.GetEnd()}) {
					if gap.vaddr > from {
						off := int64(from - p.e.GetStart())
						if err := l.cp.copyData(f, reg.off+off, p.base, p.baseOff+off, int64(gap.vaddr-from)); err != nil {
							return err
						}
					}
					from = max(from, gap.end())
				}
			}
			for _, r := range p.overlay {
				l.jobs = append(l.jobs, copyJob{doff: reg.off + int64(r.vaddr-p.e.GetStart()), src: r.f, soff: r.off, n: int64(r.n * pageSize)})
				l.mf.moved += r.n
				if p.kind != vmaFileData {
					l.mf.private += r.n
				}
			}
		}
		// Children compare against these regions: write them now.
		if err := l.flush(); err != nil {
			return err
		}
	}
	if err := l.copyPatches(ctx); err != nil {
		return err
	}
	if err := d.fc.recheck(); err != nil {
		return err
	}
	size := int64(len(l.mf.regions)) * SlotSize
	if err := f.Truncate(size); err != nil {
		return err
	}
	if err := f.Chmod(0o400); err != nil {
		return err
	}
	if tmpfs, _ := IsTmpfs(d.famDir); !tmpfs {
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
func (l *layout) tryShare(p, pp *vmaPlan) (bool, error) {
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
	if err := markData(l.mem, regOff, n, check); err != nil {
		return false, err
	}
	var total uint64
	for _, c := range check {
		if c {
			total++
		}
	}
	limit := l.ratio * float64(total)
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
		mineBuf := l.d.mapped(p, va, sz)
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
			theirs = l.d.mapped(owner, va, sz)
		}
		if theirs == nil {
			theirs = b[:sz]
			if err := fillRange(pp, l.mem, pp.regOff, va, theirs); err != nil {
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
	if differ > 0 && float64(differ) > l.ratio*float64(checked) {
		return false, nil
	}
	p.region, p.regOff, p.kept = pp.region, regOff, kept
	return true, nil
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
