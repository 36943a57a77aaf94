package memfile

import (
	"bytes"
	"cmp"
	"context"
	"fmt"
	"os"
	"slices"

	"github.com/checkpoint-restore/go-criu/v7/crit/images/vma"
	"github.com/containerd/errdefs"
	"golang.org/x/sys/unix"
	"google.golang.org/protobuf/proto"

	"github.com/lazyfork/lazyfork/api"
)

// Patched deltas (RewriteOptions.Patch): a running parent that is not moved
// again after its first snapshot keeps its writes as anonymous pages inside
// its file mappings, one mapping each, so its dumps stay cheap. Left in the
// image, those pages would be restored into every fork's private memory, all
// of them, at every later call. With Patch, the rewrite splits each such
// VMA of a copy's image into pieces instead: the base file where the parent
// did not write, and patches elsewhere, the mappings a move would have given
// the parent. A patch whose bytes a piece of the previous snapshot
// (PatchOptions.Previous) already holds maps that piece again; the rest go
// into the new memory file. Each snapshot then writes about what the parent
// wrote since the previous one, and each fork holds none of it privately.
const (
	// Written runs closer than patchGap pages are one patch (the clean pages
	// between are copied too), as in a move (rehome.patches).
	patchGap = 4
	// maxPatchesPerVMA bounds the new patches of one VMA: the closest runs
	// are joined beyond it. A patch is two more mappings in every copy; the
	// shim consolidates its parent long before (consolidateAfter), so this
	// only keeps a pathological writer's copies under the kernel's default
	// limit of 65,530 mappings.
	maxPatchesPerVMA = 8192
)

// Patch is a piece of a snapshot's patched VMA that maps a family file
// other than the VMA's base: a range of process Pid's memory whose bytes
// are File's at Offset.
type Patch = api.Patch

// PatchOptions turns on patched deltas (see RewriteOptions.Patch).
type PatchOptions struct {
	// Previous are the patches of the previous snapshot of the same
	// processes (Result.Patches): a range whose bytes equal one of them maps
	// it again. A file that is gone is skipped; equality is checked byte by
	// byte, so a stale list costs only the comparison.
	Previous []Patch
	// Copy, if set, writes the new patches' bytes into the new memory file
	// (dst, its path while it is written) instead of the rewrite: a
	// caller's helper in the memory cgroup of the processes whose writes
	// they are, so that the file is charged there. An error wrapping
	// errdefs.ErrNotImplemented has the rewrite copy them itself; any
	// other fails the rewrite.
	Copy func(ctx context.Context, dst string, copies []CopyRange) error
}

// CopyRange is Len bytes of file Src at SrcOff, for DstOff of the new
// memory file.
type CopyRange struct {
	Src            string
	SrcOff, DstOff int64
	Len            int64
}

type pieceKind int

const (
	pieceBase pieceKind = iota // the VMA's base file
	pieceNew                   // a slot of the new memory file
	piecePrev                  // a patch of the previous snapshot, mapped again
)

// piece is one mapping a patched VMA becomes.
type piece struct {
	start, end uint64
	kind       pieceKind
	name       string   // family file of a piecePrev
	f          *os.File // its descriptor
	off        int64    // file offset of start (piecePrev)
	reg        *region  // pieceNew
}

// previous returns the patches of PatchOptions.Previous for pid inside
// [start, end), by address.
func (d *dump) previous(pid uint32, start, end uint64) []Patch {
	var out []Patch
	for _, q := range d.opts.Patch.Previous {
		if q.Pid == pid && q.Start >= start && q.End <= end && q.Start < q.End &&
			q.Start%pageSize == 0 && q.End%pageSize == 0 && q.Offset%pageSize == 0 && checkFileName(q.File) == nil {
			out = append(out, q)
		}
	}
	slices.SortFunc(out, func(a, b Patch) int { return cmp.Compare(a.Start, b.Start) })
	// Overlapping entries would be a corrupt list: keep the first.
	kept := out[:0]
	for _, q := range out {
		if k := len(kept); k == 0 || kept[k-1].End <= q.Start {
			kept = append(kept, q)
		}
	}
	return kept
}

// overlaps reports whether runs (sorted) hold a page in [from, to).
func overlaps(runs []run, from, to uint64) bool {
	i, _ := slices.BinarySearchFunc(runs, from, func(r run, va uint64) int {
		if r.end() <= va {
			return -1
		}
		return 1
	})
	return i < len(runs) && runs[i].vaddr < to
}

// patch splits the family VMA p of task t into pieces (layout phase):
// previous patches whose bytes it still shows, new patches in the memory
// file for its other written pages, and its base file around them. It
// queues the new patches' copies.
func (l *layout) patch(t *task, p *vmaPlan, regBase uint32) error {
	start, end := p.e.GetStart(), p.e.GetEnd()
	var written, fresh uint64 // its written pages; of them, those in new patches
	for _, r := range p.overlay {
		written += r.n
	}
	l.mf.private += written
	var reused []piece
	var a, b []byte
	for _, q := range l.d.previous(t.pid, start, end) {
		if !overlaps(p.overlay, q.Start, q.End) {
			continue // it shows its base there: no patch needed
		}
		f, err := l.d.openFamilyFile(q.File)
		if err != nil {
			continue // gone (freed with the snapshot that held it)
		}
		n := int(q.End - q.Start)
		if cap(a) < n {
			a, b = make([]byte, n), make([]byte, n)
		}
		if err := fillRange(p, nil, 0, q.Start, a[:n]); err != nil {
			return err
		}
		if err := readFull(f, q.Offset, b[:n]); err != nil {
			return err
		}
		if bytes.Equal(a[:n], b[:n]) {
			reused = append(reused, piece{start: q.Start, end: q.End, kind: piecePrev, name: q.File, f: f, off: q.Offset})
		}
	}
	// The written pages no reused patch holds, as runs joined across small
	// gaps that no reused patch sits in.
	var spans [][2]uint64
	ri := 0
	for _, r := range p.overlay {
		for va := r.vaddr; va < r.end(); {
			for ri < len(reused) && reused[ri].end <= va {
				ri++
			}
			if ri < len(reused) && reused[ri].start <= va {
				va = reused[ri].end
				continue
			}
			stop := r.end()
			if ri < len(reused) {
				stop = min(stop, reused[ri].start)
			}
			if k := len(spans); k > 0 && va-spans[k-1][1] < patchGap*pageSize &&
				(ri == 0 || reused[ri-1].end <= spans[k-1][1]) {
				spans[k-1][1] = stop
			} else {
				spans = append(spans, [2]uint64{va, stop})
			}
			va = stop
		}
	}
	spans = joinClosest(spans, reused, maxPatchesPerVMA)
	pieces := reused
	for _, s := range spans {
		reg := &region{slot: len(l.mf.regions), off: int64(len(l.mf.regions)) * SlotSize, regID: regBase, owner: p}
		l.mf.regions = append(l.mf.regions, reg)
		pieces = append(pieces, piece{start: s[0], end: s[1], kind: pieceNew, reg: reg})
		// The bytes it shows: its base, its own pages on top.
		from := s[0]
		for _, r := range p.overlay {
			r = r.slice(s[0], s[1])
			if r.n == 0 {
				continue
			}
			if r.vaddr > from {
				l.patchCopy(reg.off+int64(from-s[0]), p.base, p.baseOff+int64(from-start), int64(r.vaddr-from))
			}
			l.patchCopy(reg.off+int64(r.vaddr-s[0]), r.f, r.off, int64(r.n*pageSize))
			fresh += r.n
			from = r.end()
		}
		if s[1] > from {
			l.patchCopy(reg.off+int64(from-s[0]), p.base, p.baseOff+int64(from-start), int64(s[1]-from))
		}
	}
	slices.SortFunc(pieces, func(x, y piece) int { return cmp.Compare(x.start, y.start) })
	// The base around them.
	var all []piece
	from := start
	for _, pc := range pieces {
		if pc.start > from {
			all = append(all, piece{start: from, end: pc.start, kind: pieceBase})
		}
		all = append(all, pc)
		from = pc.end
	}
	if end > from {
		all = append(all, piece{start: from, end: end, kind: pieceBase})
	}
	p.pieces = all
	// Every written page is in a new patch or a reused one.
	l.mf.moved += written
	l.mf.reused += written - fresh
	return nil
}

// patchCopy queues n bytes of src at soff for doff of the new memory file.
func (l *layout) patchCopy(doff int64, src *os.File, soff, n int64) {
	if k := len(l.patchCopies); k > 0 {
		c := &l.patchCopies[k-1]
		if c.src == src && c.soff+c.n == soff && c.doff+c.n == doff {
			c.n += n
			return
		}
	}
	l.patchCopies = append(l.patchCopies, copyJob{doff: doff, src: src, soff: soff, n: n})
}

// copyPatches writes the queued patch copies: through PatchOptions.Copy if
// set (and able), else as the rest of the file.
func (l *layout) copyPatches(ctx context.Context) error {
	copies := l.patchCopies
	l.patchCopies = nil
	if len(copies) == 0 {
		return nil
	}
	if cp := l.d.opts.Patch.Copy; cp != nil {
		rs := make([]CopyRange, len(copies))
		for i, c := range copies {
			rs[i] = CopyRange{Src: c.src.Name(), SrcOff: c.soff, DstOff: c.doff, Len: c.n}
		}
		err := cp(ctx, l.mf.file.path, rs)
		if err == nil {
			for _, c := range copies {
				l.mf.written += c.n
			}
			return nil
		}
		if !errdefs.IsNotImplemented(err) {
			return fmt.Errorf("copy patches: %w", err)
		}
	}
	for _, c := range copies {
		if err := l.cp.copy(l.mem, c.doff, c.src, c.soff, c.n); err != nil {
			return err
		}
	}
	return nil
}

// joinClosest joins neighbouring spans, closest first, until at most limit
// remain; spans with a reused patch between them are never joined.
func joinClosest(spans [][2]uint64, reused []piece, limit int) [][2]uint64 {
	if len(spans) <= limit {
		return spans
	}
	// gaps[k] is the gap before spans[k+1]; a reused patch in it bars it.
	type gap struct {
		k    int
		size uint64
	}
	var gaps []gap
	ri := 0
	for k := 0; k+1 < len(spans); k++ {
		from, to := spans[k][1], spans[k+1][0]
		for ri < len(reused) && reused[ri].end <= from {
			ri++
		}
		if ri < len(reused) && reused[ri].start < to {
			continue
		}
		gaps = append(gaps, gap{k, to - from})
	}
	slices.SortStableFunc(gaps, func(a, b gap) int { return cmp.Compare(a.size, b.size) })
	joined := make([]bool, len(spans))
	for _, g := range gaps[:min(len(gaps), len(spans)-limit)] {
		joined[g.k] = true // spans[k] runs on into spans[k+1]
	}
	out := spans[:0]
	for k := 0; k < len(spans); k++ {
		if k > 0 && joined[k-1] {
			out[len(out)-1][1] = spans[k][1]
			continue
		}
		out = append(out, spans[k])
	}
	return out
}

// expandPatched replaces each patched VMA of the dump's tasks by its pieces
// (stage phase), in the mm image and in the plans the rest of the stage
// reads: a base piece is a family mapping without pages in the image, a new
// patch a converted mapping of its region, a reused patch a family mapping
// of the previous snapshot's file (given a files.img entry here). It
// returns the patches, for Result.Patches.
func (sg *stager) expandPatched(memName string) ([]Patch, error) {
	d := sg.d
	ids := map[string]uint32{}
	for id, name := range d.famFiles {
		if old, ok := ids[name]; !ok || id < old {
			ids[name] = id
		}
	}
	var out []Patch
	for _, t := range d.tasks {
		if t.mm == nil || !slices.ContainsFunc(t.vmas, func(p *vmaPlan) bool { return p.pieces != nil }) {
			continue
		}
		var plans []*vmaPlan
		var entries []*vma.VmaEntry
		for _, p := range t.vmas {
			if p.pieces == nil {
				plans = append(plans, p)
				entries = append(entries, p.e)
				continue
			}
			for _, pc := range p.pieces {
				e := proto.Clone(p.e).(*vma.VmaEntry)
				e.Start, e.End = ptr(pc.start), ptr(pc.end)
				np := &vmaPlan{e: e, kind: vmaFamily}
				switch pc.kind {
				case pieceBase:
					np.baseName, np.base = p.baseName, p.base
					np.baseOff = p.baseOff + int64(pc.start-p.e.GetStart())
					e.Pgoff = ptr(uint64(np.baseOff))
				case pieceNew:
					np.convert, np.region, np.regOff = true, pc.reg, pc.reg.off
					out = append(out, Patch{Pid: t.pid, Start: pc.start, End: pc.end, File: memName, Offset: pc.reg.off})
				case piecePrev:
					id, ok := ids[pc.name]
					if !ok {
						var err error
						if id, err = sg.addFamilyFile(pc.name, pc.f); err != nil {
							return nil, err
						}
						ids[pc.name] = id
					}
					np.baseName, np.base, np.baseOff = pc.name, pc.f, pc.off
					e.Shmid, e.Pgoff = ptr(uint64(id)), ptr(uint64(pc.off))
					out = append(out, Patch{Pid: t.pid, Start: pc.start, End: pc.end, File: pc.name, Offset: pc.off})
				}
				plans = append(plans, np)
				entries = append(entries, e)
			}
		}
		t.vmas = plans
		t.mm.MM.Vmas = entries
	}
	return out, nil
}

// addFamilyFile gives family file name (open as f) a files.img entry of its
// own, recorded like the dump's family files, and returns its id.
func (sg *stager) addFamilyFile(name string, f *os.File) (uint32, error) {
	st, err := f.Stat()
	if err != nil {
		return 0, err
	}
	if !st.Mode().IsRegular() {
		return 0, fmt.Errorf("family file %s is not a regular file: %w", name, errdefs.ErrFailedPrecondition)
	}
	id := sg.nextID
	sg.nextID++
	fe := sg.regFileNamed(id, name, st, uint32(st.Mode().Perm())|unix.S_IFREG)
	sg.added = append(sg.added, fe)
	sg.d.famFiles[id] = name
	return id, nil
}
