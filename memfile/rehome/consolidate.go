package rehome

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"slices"

	"github.com/containerd/errdefs"
	"golang.org/x/sys/unix"

	"github.com/lazyfork/lazyfork/internal/fileextent"
)

// Consolidation: a process that keeps writing pages spread over a moved
// heap gets, at each move, one patch mapping per island of written pages
// (PlanOptions.MemDir): its heap becomes thousands of mappings of a dozen
// files, and so does every fork restored from its dumps. Each mapping costs
// the kernel about 400 bytes in every copy (vm_area_struct, struct file,
// maple nodes: measured 391 bytes per VMA of a fork's kmem), and every later
// dump and move a few microseconds (CRIU and smaps read each one).
//
// A consolidation puts such a fragmented region back into one mapping of one
// new file, in two steps:
//
//   - Fragments and PrepareRegions, while the process runs: a region is a
//     run of address-adjacent private mappings of memory files with one
//     protection. Its bytes, as the process sees them where it did not write
//     since, are the files' bytes at each piece's offset: the files never
//     change (sealed), so they are copied (copy_file_range, holes kept) into
//     a slot of the new file without stopping the process.
//   - Move of the region with Prepared set, while the process is stopped: its
//     pieces must still be exactly the recorded ones (same ranges, files and
//     offsets); the pages it wrote (its private copies: anonymous pages
//     inside the file mappings, or swapped) are written into the slot on top,
//     zeros included, and the whole region is mapped from the slot at once.
//     The process then holds one mapping and no private page there, and its
//     next dump holds none of it.
//
// A region whose pieces changed between the two steps is refused by the move
// (its slot is wasted; the process keeps its mappings).

// Piece is one mapping of a fragmented region, as /proc/pid/maps shows it.
type Piece struct {
	Start, End uint64
	Offset     uint64 // file offset of Start
	Dev        string // maps' major:minor (hex)
	Inode      uint64
	Path       string // the file as the process sees it
}

// Fragments returns the fragmented regions of process pid: runs of at least
// two address-adjacent private mappings of files under memDir (as the
// process sees them) with one protection and none of the VmFlags of
// skipFlags, each a VMA with Prepared set and its Pieces, slots 0, 1, 2...
// With private, a run of one mapping counts too when it holds pages the
// process wrote (anonymous pages inside it): a parent that runs on its
// files without moving again keeps its writes there (VMA.HoldsPrivate).
// It reads /proc/pid/smaps (the process may run).
func Fragments(pid int, memDir string, private bool) ([]VMA, error) {
	b, err := readProc(pid, "smaps", 0)
	if err != nil {
		return nil, err
	}
	var out []VMA
	var cur VMA // the region being built
	var piece Piece
	var pieceOK bool
	var hv VMA        // the header of the mapping being read
	var anonKB uint64 // written pages of the mapping being read
	flush := func() {
		if len(cur.Pieces) >= 2 || private && cur.HoldsPrivate {
			cur.Slot = len(out)
			cur.Pages = cur.Len() / pageSize
			out = append(out, cur)
		}
		cur = VMA{}
	}
	smapsLines(b, "ASV", func(l []byte) {
		m, _ := splitMaps(l)
		hv, _ = m.vma()
		anonKB = 0
		piece, pieceOK = Piece{}, false
		if m.memFile(memDir) && !bytes.HasSuffix(m.name, []byte(" (deleted)")) {
			piece = Piece{Start: m.start, End: m.end, Offset: m.offset, Dev: string(m.dev), Inode: m.inode, Path: hv.Name}
			pieceOK = true
		}
	}, func(l []byte) {
		// Written pages: anonymous, or swapped out.
		if kb, found := bytes.CutPrefix(l, []byte("Anonymous:")); found {
			anonKB += parseKB(kb)
			return
		}
		if kb, found := bytes.CutPrefix(l, []byte("Swap:")); found {
			anonKB += parseKB(kb)
			return
		}
		rest, found := bytes.CutPrefix(l, []byte("VmFlags:"))
		if !found {
			return
		}
		flags, skip := 0, false
		for _, fl := range bytes.Fields(rest) {
			skip = skip || skipFlags[string(fl)]
			if string(fl) == "nr" {
				flags |= unix.MAP_NORESERVE
			}
		}
		if !pieceOK || skip {
			flush()
			return
		}
		if len(cur.Pieces) > 0 && (cur.End != piece.Start || cur.Prot != hv.Prot || cur.Flags != flags) {
			flush()
		}
		if len(cur.Pieces) == 0 {
			cur = VMA{Start: piece.Start, Prot: hv.Prot, Flags: flags, Prepared: true, Name: "(consolidated)"}
		}
		cur.End = piece.End
		cur.Pieces = append(cur.Pieces, piece)
		cur.HoldsPrivate = cur.HoldsPrivate || anonKB > 0
	})
	flush()
	return out, nil
}

// Pieces counts the pieces of regions.
func Pieces(regions []VMA) int {
	n := 0
	for _, r := range regions {
		n += len(r.Pieces)
	}
	return n
}

// PrepareRegions copies the bytes of each region's pieces from their files,
// found by base name in hostDir (the family's files as the caller sees
// them), into f at the region's slot (the piece at its place in the
// region), keeping holes. A piece whose file is not the one the process
// maps (device and inode) fails its region. It returns the regions
// prepared and the bytes copied; the others are left out, with their
// errors joined.
func PrepareRegions(regions []VMA, hostDir string, f *os.File) ([]VMA, int64, error) {
	var done []VMA
	var copied int64
	var errs []error
	if err := extend(0, regions, f); err != nil {
		return nil, 0, err
	}
	type source struct {
		f       *os.File
		extents []fileextent.Extent
	}
	files := map[string]source{}
	defer func() {
		for _, sf := range files {
			sf.f.Close()
		}
	}()
regions:
	for _, r := range regions {
		if !r.Prepared || len(r.Pieces) == 0 {
			errs = append(errs, fmt.Errorf("rehome: region %v has no pieces: %w", r, errdefs.ErrInvalidArgument))
			continue
		}
		for _, p := range r.Pieces {
			src, ok := files[p.Path]
			if !ok {
				sf, err := openPiece(hostDir, p)
				if err != nil {
					errs = append(errs, err)
					continue regions
				}
				ext, err := fileextent.Data(sf)
				if err != nil {
					sf.Close()
					errs = append(errs, fmt.Errorf("rehome: memory file %s: %w", p.Path, err))
					continue regions
				}
				src = source{sf, ext}
				files[p.Path] = src
			}
			n, err := copyRange(f, r.Offset()+int64(p.Start-r.Start), src.f, src.extents, int64(p.Offset), int64(p.End-p.Start))
			copied += n
			if err != nil {
				errs = append(errs, fmt.Errorf("rehome: region %v: copy %s at %#x: %w", r, p.Path, p.Offset, err))
				continue regions
			}
		}
		done = append(done, r)
	}
	return done, copied, errors.Join(errs...)
}

// openPiece opens the host's copy of the file a piece maps and checks it is
// that file.
func openPiece(hostDir string, p Piece) (*os.File, error) {
	path := filepath.Join(hostDir, filepath.Base(p.Path))
	src, err := os.Open(path)
	if err != nil {
		return nil, fmt.Errorf("rehome: memory file %s of %#x-%#x: %w", path, p.Start, p.End, err)
	}
	var st unix.Stat_t
	if err := unix.Fstat(int(src.Fd()), &st); err != nil {
		src.Close()
		return nil, err
	}
	dev := fmt.Sprintf("%02x:%02x", unix.Major(st.Dev), unix.Minor(st.Dev))
	if st.Ino != p.Inode || dev != p.Dev {
		src.Close()
		return nil, fmt.Errorf("rehome: memory file %s is %s %d, the process maps %s %d at %#x: %w",
			path, dev, st.Ino, p.Dev, p.Inode, p.Start, errdefs.ErrFailedPrecondition)
	}
	return src, nil
}

// copyRange copies n bytes of src at off into dst at dstOff, the parts in
// src's data extents only: holes stay holes. It returns the bytes copied.
func copyRange(dst *os.File, dstOff int64, src *os.File, extents []fileextent.Extent, off, n int64) (int64, error) {
	var copied int64
	start, end := off, off+n
	for i := fileextent.From(extents, off); i < len(extents) && extents[i].Start < end; i++ {
		data, hole := max(extents[i].Start, start), min(extents[i].End, end)
		for data < hole {
			in, out := data, dstOff+(data-start)
			w, err := unix.CopyFileRange(int(src.Fd()), &in, int(dst.Fd()), &out, int(hole-data), 0)
			if err != nil {
				return copied, err
			}
			if w == 0 {
				return copied, io.ErrUnexpectedEOF
			}
			copied += int64(w)
			data += int64(w)
		}
	}
	return copied, nil
}

// mapping is one line of /proc/pid/maps, parsed.
type mapping struct {
	VMA
	dev     string // major:minor (hex)
	inode   uint64
	private bool
}

// parseMapping parses a maps line (or an smaps header line).
func parseMapping(l []byte) (mapping, bool) {
	m, ok := splitMaps(l)
	if !ok {
		return mapping{}, false
	}
	v, _ := m.vma()
	return mapping{VMA: v, dev: string(m.dev), inode: m.inode, private: m.perms[3] == 'p'}, true
}

// parseMappings parses the mapping lines of maps (the content of
// /proc/pid/maps), in their order: by address.
func parseMappings(maps []byte) []mapping {
	var out []mapping
	for l := range bytes.SplitSeq(maps, []byte("\n")) {
		if m, ok := parseMapping(l); ok {
			out = append(out, m)
		}
	}
	return out
}

// checkPieces verifies, against the process's mappings (parseMappings), that
// the mappings of process pid inside region r are exactly r's pieces: same
// ranges, protection, files and offsets. (Parsed once for all regions: a
// fragmented heap has thousands of mappings, read while the container is
// paused.)
func checkPieces(pid int, ms []mapping, r VMA) error {
	changed := func(why string) error {
		return fmt.Errorf("rehome: process %d: region %v changed since it was prepared (%s): %w", pid, r, why, errdefs.ErrFailedPrecondition)
	}
	i := 0
	first, _ := slices.BinarySearchFunc(ms, r.Start, func(m mapping, a uint64) int {
		if m.End <= a {
			return -1
		}
		return 1
	})
	for _, m := range ms[first:] {
		if m.Start >= r.End {
			break
		}
		if i >= len(r.Pieces) {
			return changed("more mappings")
		}
		p := r.Pieces[i]
		if m.Start != p.Start || m.End != p.End || m.FileOffset != p.Offset || m.Prot != r.Prot ||
			m.dev != p.Dev || m.inode != p.Inode || !m.private {
			return changed(fmt.Sprintf("%#x-%#x", m.Start, m.End))
		}
		i++
	}
	if i != len(r.Pieces) {
		return changed("mappings gone")
	}
	return nil
}

// StillPrepared returns the regions of process pid (stopped) that a move may
// map from their consolidation: each checked on its own against the
// process's mappings now (a region changed since its preparation is left
// out, not the whole process), and none overlapping a mapping whose VmFlags
// are in skipFlags (locked, userfaultfd-registered, don't-fork, sealed ...
// since the preparation: mapping the region anew would drop the property).
func StillPrepared(pid int, regions []VMA) ([]VMA, error) {
	// smaps alone (its headers are maps' lines): the container is paused
	// while thousands of them are read.
	smaps, err := readProc(pid, "smaps", (Pieces(regions)+256)*smapsBytesPerMapping)
	if err != nil {
		return nil, err
	}
	var flagged [][2]uint64
	var cur mapping
	var ms []mapping // smaps' header lines: maps
	smapsLines(smaps, "V", func(l []byte) {
		if m, ok := parseMapping(l); ok {
			cur = m
			ms = append(ms, m)
		}
	}, func(l []byte) {
		rest, found := bytes.CutPrefix(l, []byte("VmFlags:"))
		if !found {
			return
		}
		for _, fl := range bytes.Fields(rest) {
			if skipFlags[string(fl)] {
				flagged = append(flagged, [2]uint64{cur.Start, cur.End})
				return
			}
		}
	})
	var out []VMA
	for _, r := range regions {
		if checkPieces(pid, ms, r) != nil {
			continue
		}
		if slices.ContainsFunc(flagged, func(f [2]uint64) bool { return f[0] < r.End && r.Start < f[1] }) {
			continue
		}
		out = append(out, r)
	}
	return out, nil
}
