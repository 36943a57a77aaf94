package rehome

import (
	"bytes"
	"cmp"
	"errors"
	"fmt"
	"io"
	"os"
	"slices"
	"strconv"
	"strings"

	"github.com/containerd/errdefs"
	"golang.org/x/sys/unix"
)

// SlotSize is the distance between the regions of two converted VMAs in a
// memory file: slot i starts at offset i*SlotSize. It is the layout of the
// CRIU-image rewrite (memfile.SlotSize): an mremap growth of a VMA reads
// zeros (holes), and no two VMAs map adjacent file offsets, so the kernel
// never merges neighbours.
const SlotSize int64 = 1 << 40

const pageSize = 4096

// VMA is a private anonymous mapping of a process chosen for conversion.
type VMA struct {
	Start, End uint64
	Prot       int    // PROT_* of the mapping
	Flags      int    // extra mmap flags to keep (MAP_NORESERVE)
	Slot       int    // slot of the memory file the VMA maps (offset Slot*SlotSize)
	Pages      uint64 // pages the VMA holds, resident or swapped (from smaps)
	Name       string // "" or "[heap]" or "[anon:...]", or the file of a .data mapping
	// Whole: a program's or library's dirty .data (a private writable
	// mapping of a file the process also maps executable): every page is
	// copied, clean ones from the file included, since a hole would read
	// zeros instead of the file's bytes.
	Whole bool
	// FileOffset is the offset of the file the VMA maps (maps' third field).
	FileOffset uint64
	// Replaces is, for a patch of a memory-file mapping, that file as the
	// process sees it: once moved, the patch's pages no longer come from it
	// (at ReplacesOffset) in this process.
	Replaces       string
	ReplacesOffset uint64
	// Prepared: a fragmented region (Fragments) whose slot already holds
	// the bytes of its Pieces (PrepareRegions). A move checks the pieces
	// are unchanged, writes only the pages the process wrote (its private
	// copies, zeros included) and maps the whole region from the slot.
	Prepared bool    `json:",omitempty"`
	Pieces   []Piece `json:",omitempty"`
	// HoldsPrivate: a region of Fragments with pages its process wrote
	// (anonymous pages in its mappings) when it was found.
	HoldsPrivate bool `json:",omitempty"`
	// PreCopied: a private anonymous VMA whose slot holds a copy made
	// while the process ran (PreCopy): a move writes only the pages
	// written since (zeros included) and maps it whole.
	PreCopied bool `json:",omitempty"`
	// written holds, once a move scanned a Prepared VMA whole (scanned),
	// the runs of pages its process wrote: the move's chunks take theirs
	// from it.
	written [][2]uint64
	scanned bool
}

// Offset is the file offset the VMA's first page maps.
func (v VMA) Offset() int64 { return int64(v.Slot) * SlotSize }

// Len is the VMA's length in bytes.
func (v VMA) Len() uint64 { return v.End - v.Start }

func (v VMA) String() string {
	return fmt.Sprintf("%#x-%#x%s", v.Start, v.End, map[bool]string{true: " " + v.Name}[v.Name != ""])
}

// skipFlags are the smaps VmFlags of VMAs that stay as they are: a stack
// (gd), locked (lo, lf), wipe-on-fork (wf), hugetlb (ht), shared (sh),
// shadow stack (ss), userfaultfd-registered (um, uw), don't-fork (dc),
// I/O and PFN maps (io, pf), don't-expand (de), sealed (sl), MTE (mt). A
// file mapping would lose the property, or the kernel refuses to replace it.
var skipFlags = map[string]bool{
	"gd": true, "lo": true, "lf": true, "wf": true, "ht": true, "sh": true, "ss": true,
	"um": true, "uw": true, "dc": true, "io": true, "pf": true, "de": true, "sl": true, "mt": true,
}

// Plan reads /proc/pid/smaps and returns the VMAs of process pid to convert,
// sorted by address, with slots 0, 1, 2... (add an offset to share one file
// among processes). A VMA qualifies if it is private anonymous memory (no
// file, or [heap], or a named [anon:...] region), holds pages, and has none
// of the VmFlags listed in skipFlags. The process must stay stopped from
// Plan until Remap returns.
func Plan(pid int) ([]VMA, error) { return PlanWith(pid, PlanOptions{}) }

// PlanOptions extends Plan.
type PlanOptions struct {
	// MemDir is where the process sees memory files (e.g. /.lazyfork/mem).
	// When set, the pages the process wrote since it was moved (its own
	// copies inside private mappings of memory files) are planned too, as
	// patches: Whole VMAs covering runs of written pages, which a move maps
	// from the new file. The process then holds none of them privately, and
	// its next dump holds only what it writes after this move.
	MemDir string
	// WipeOnFork, when set, is called with each VMA marked
	// MADV_WIPEONFORK (VmFlags "wf", never converted): the dump needs
	// those ranges, and the plan's smaps read, the costliest read of a
	// fragmented process, holds them already.
	WipeOnFork func(start, end uint64)
	// WriteProtected, when set, says whether a VMA registered with a
	// userfaultfd for write protection (VmFlags "uw") is a precopy's
	// (PreCopy.Protects): those are planned; any other stays as it is.
	WriteProtected func(start, end uint64) bool
}

// Patch limits: runs of written pages closer than patchGap pages are one
// patch (the clean pages between are copied too: with 16, a python parent's
// scattered interpreter writes made each move twice what it wrote; with 4,
// 1.3-1.5x). Each patch
// splits its mapping, so a mapping gets at most maxPatches per move (its
// largest runs; the rest stay in the next dump as a delta and are tried at
// the next move), and a process holding maxMappings mappings or more gets
// none: CRIU opens a file per mapping at each restore. A page left in the
// delta costs every fork 4 KiB, a patch about 800 bytes (two more mappings
// of 391 bytes of kernel memory each, measured), and the shim consolidates
// the mappings patches made (Fragments), so the cap is 512: with 128, a
// parent's 256 spread pages per call left 128 in each fork's delta (forks of
// such a call 1.7-1.8 MB, 0.9-1.2 MB with 512).
const (
	patchGap    = 4
	maxPatches  = 512
	maxMappings = 8192
)

// PlanWith is Plan with options.
func PlanWith(pid int, opts PlanOptions) ([]VMA, error) {
	smaps, err := readProc(pid, "smaps", 256<<10)
	if err != nil {
		return nil, err
	}
	execFiles, mappings := executableFiles(smaps)
	if mappings >= maxMappings {
		opts.MemDir = "" // no more splits: written pages stay a delta
	}
	var out []VMA
	var pm *os.File
	defer func() {
		if pm != nil {
			pm.Close()
		}
	}()
	var cur VMA
	var ok bool // cur qualifies so far
	var kb, anonKB uint64
	var patchable bool // cur maps a memory file privately
	smapsLines(smaps, "VARS", func(l []byte) {
		m, _ := splitMaps(l)
		v, good := m.vma()
		cur, ok, kb, anonKB, patchable = v, good, 0, 0, false
		switch {
		case good:
		case opts.MemDir != "" && m.memFile(opts.MemDir):
			patchable = true
		case m.data(execFiles):
			cur.Whole, ok = true, true
		}
	}, func(l []byte) {
		if err != nil {
			return
		}
		if rest, found := bytes.CutPrefix(l, []byte("Anonymous:")); found {
			anonKB += parseKB(rest)
			return
		}
		if rest, found := bytes.CutPrefix(l, []byte("Rss:")); found {
			kb += parseKB(rest)
			return
		}
		if rest, found := bytes.CutPrefix(l, []byte("Swap:")); found {
			kb += parseKB(rest)
			return
		}
		rest, found := bytes.CutPrefix(l, []byte("VmFlags:"))
		if !found {
			return
		}
		skip := false
		for _, fl := range bytes.Fields(rest) {
			if skipFlags[string(fl)] && (string(fl) != "uw" || opts.WriteProtected == nil || !opts.WriteProtected(cur.Start, cur.End)) {
				ok, skip = false, true
			}
			if string(fl) == "wf" && opts.WipeOnFork != nil {
				opts.WipeOnFork(cur.Start, cur.End)
			}
			if string(fl) == "nr" {
				cur.Flags |= unix.MAP_NORESERVE
			}
		}
		if cur.Whole && anonKB == 0 {
			ok = false // clean .data: the file has its bytes already
		}
		if patchable && anonKB > 0 && !skip {
			if pm == nil {
				// One descriptor for every patchable mapping: a
				// fragmented heap has hundreds.
				if pm, err = os.Open(fmt.Sprintf("/proc/%d/pagemap", pid)); err != nil {
					err = fmt.Errorf("rehome: process %d: pagemap: %w", pid, err)
					return
				}
			}
			var ps []VMA
			if ps, err = patches(pm, pid, cur); err != nil {
				return
			}
			for _, p := range ps {
				p.Slot = len(out)
				out = append(out, p)
			}
		}
		if ok && kb > 0 {
			cur.Pages = kb * 1024 / pageSize
			if cur.Whole {
				cur.Pages = cur.Len() / pageSize
			}
			cur.Slot = len(out)
			out = append(out, cur)
		}
		ok = false
	})
	if err != nil {
		return nil, err
	}
	return out, nil
}

// readProc reads a /proc file of process pid (maps, smaps) into a buffer of
// about sizeHint bytes, doubled when short: os.ReadFile grows its buffer
// from 512 bytes a quarter at a time for a file whose size stat does not
// tell, and the smaps of a fragmented process (1.7 MB at 2,200 mappings)
// is read while the container is paused.
func readProc(pid int, name string, sizeHint int) ([]byte, error) {
	f, err := os.Open(fmt.Sprintf("/proc/%d/%s", pid, name))
	if err != nil {
		return nil, fmt.Errorf("rehome: process %d: %w", pid, errors.Join(err, errdefs.ErrNotFound))
	}
	defer f.Close()
	b := make([]byte, 0, max(sizeHint, 64<<10))
	for {
		if len(b) == cap(b) {
			b = slices.Grow(b, cap(b))
		}
		n, err := f.Read(b[len(b):cap(b)])
		b = b[:len(b)+n]
		if err == io.EOF || err == nil && n == 0 {
			return b, nil
		}
		if errors.Is(err, unix.ESRCH) {
			err = errors.Join(err, errdefs.ErrNotFound) // gone since the open
		}
		if err != nil {
			return nil, fmt.Errorf("rehome: process %d: %s: %w", pid, name, err)
		}
	}
}

// smapsBytesPerMapping is about what smaps prints for one mapping.
const smapsBytesPerMapping = 800

// smapsLines calls header for each mapping's header line of smaps (an
// address in lower-case hex: a line of maps) and field for each of its ~25
// field lines (a capital) whose first byte is in fields: a plan or a check reads
// tens of thousands of lines while the container is paused, most of which
// it only needs to skip.
func smapsLines(smaps []byte, fields string, header, field func(l []byte)) {
	for len(smaps) > 0 {
		l := smaps
		if i := bytes.IndexByte(smaps, '\n'); i >= 0 {
			l, smaps = smaps[:i], smaps[i+1:]
		} else {
			smaps = nil
		}
		switch {
		case len(l) == 0:
		case '0' <= l[0] && l[0] <= '9' || 'a' <= l[0] && l[0] <= 'f':
			header(l)
		case strings.IndexByte(fields, l[0]) >= 0:
			field(l)
		}
	}
}

// executableFiles are the files a process maps executable (a program and
// its libraries), from its smaps' headers (its maps), and how many mappings
// it has.
func executableFiles(smaps []byte) (map[fileID]bool, int) {
	out := map[fileID]bool{}
	n := 0
	smapsLines(smaps, "", func(l []byte) {
		m, ok := splitMaps(l)
		if !ok {
			return
		}
		n++
		if m.perms[2] == 'x' && m.inode != 0 {
			out[m.file()] = true
		}
	}, nil)
	return out, n
}

// fileID names a mapped file: maps' device and inode.
type fileID struct {
	dev   string
	inode uint64
}

// mapsLine is a line of /proc/pid/maps (an smaps header), "start-end perms
// offset dev inode [name]", split without copying: a plan or a check splits
// thousands while the container is paused.
type mapsLine struct {
	start, end, offset, inode uint64
	perms, dev                []byte // perms: 4 bytes
	name                      []byte // the rest of the line ("" for none)
}

// splitMaps splits a maps line; ok is false for anything else (an smaps
// field line).
func splitMaps(l []byte) (m mapsLine, ok bool) {
	if len(l) == 0 || !isLowerHex(l[0]) {
		return m, false
	}
	var f [5][]byte
	rest := l
	for i := range f {
		rest = bytes.TrimLeft(rest, " \t")
		j := bytes.IndexAny(rest, " \t")
		if j < 0 {
			j = len(rest)
		}
		f[i], rest = rest[:j], rest[j:]
	}
	lo, hi, found := bytes.Cut(f[0], []byte("-"))
	if !found || len(f[1]) != 4 || len(f[4]) == 0 {
		return m, false
	}
	var ok1, ok2, ok3, ok4 bool
	m.start, ok1 = parseHex(lo)
	m.end, ok2 = parseHex(hi)
	m.offset, ok3 = parseHex(f[2])
	m.inode, ok4 = parseDec(f[4])
	if !ok1 || !ok2 || !ok3 || !ok4 || bytes.IndexByte(f[3], ':') < 0 {
		return m, false
	}
	m.perms, m.dev = f[1], f[3]
	m.name = bytes.TrimRight(bytes.TrimLeft(rest, " \t"), " \t")
	return m, true
}

func (m mapsLine) file() fileID { return fileID{string(m.dev), m.inode} }

// vma is the line as a VMA; good says whether it is a private anonymous
// mapping (no file, or [heap], or a named [anon:...] region).
func (m mapsLine) vma() (v VMA, good bool) {
	if m.perms == nil {
		return v, false
	}
	v.Start, v.End, v.FileOffset = m.start, m.end, m.offset
	if m.perms[0] == 'r' {
		v.Prot |= unix.PROT_READ
	}
	if m.perms[1] == 'w' {
		v.Prot |= unix.PROT_WRITE
	}
	if m.perms[2] == 'x' {
		v.Prot |= unix.PROT_EXEC
	}
	if len(m.name) > 0 {
		v.Name = string(m.name)
	}
	anonName := len(m.name) == 0 || string(m.name) == "[heap]" || bytes.HasPrefix(m.name, []byte("[anon:"))
	return v, m.perms[3] == 'p' && m.inode == 0 && anonName
}

// data reports whether the line is a program's or library's .data: private,
// writable, not executable, of a file the process maps executable.
func (m mapsLine) data(execFiles map[fileID]bool) bool {
	if m.perms == nil || string(m.perms[1:]) != "w-p" || m.inode == 0 || len(m.name) == 0 || m.name[0] != '/' {
		return false
	}
	return execFiles[m.file()]
}

// memFile reports whether the line is a private mapping of a file under dir.
func (m mapsLine) memFile(dir string) bool {
	return m.perms != nil && m.perms[3] == 'p' && m.inode != 0 &&
		bytes.HasPrefix(m.name, []byte(strings.TrimSuffix(dir, "/")+"/"))
}

func isLowerHex(c byte) bool { return '0' <= c && c <= '9' || 'a' <= c && c <= 'f' }

// parseHex parses maps' lower-case hex (addresses, offsets).
func parseHex(b []byte) (uint64, bool) {
	if len(b) == 0 || len(b) > 16 {
		return 0, false
	}
	var n uint64
	for _, c := range b {
		switch {
		case '0' <= c && c <= '9':
			n = n<<4 | uint64(c-'0')
		case 'a' <= c && c <= 'f':
			n = n<<4 | uint64(c-'a'+10)
		default:
			return 0, false
		}
	}
	return n, true
}

// parseDec parses maps' inode numbers.
func parseDec(b []byte) (uint64, bool) {
	if len(b) == 0 || len(b) > 20 {
		return 0, false
	}
	var n uint64
	for _, c := range b {
		if c < '0' || c > '9' {
			return 0, false
		}
		n = n*10 + uint64(c-'0')
	}
	return n, true
}

// patches finds the runs of pages v's process (its pagemap pm) wrote
// inside v, a private mapping of a memory file (anonymous copies: present
// without the file-page bit, or swapped), joins runs closer than patchGap
// pages, and then the closest ones until there are at most maxPatches.
func patches(pm *os.File, pid int, v VMA) ([]VMA, error) {
	written, guard, err := scanWritten(pm, v.Start, v.End)
	if errors.Is(err, errNoScan) {
		written, guard, err = readWritten(pm, v.Start, v.End)
	}
	if err != nil {
		return nil, fmt.Errorf("rehome: process %d: %v: %w", pid, v, err)
	}
	if guard {
		return nil, nil // guard pages: leave the mapping alone
	}
	var runs [][2]uint64 // page indexes [first, end)
	for _, w := range written {
		first, last := (w[0]-v.Start)/pageSize, (w[1]-v.Start)/pageSize
		if len(runs) > 0 && first-runs[len(runs)-1][1] < patchGap {
			runs[len(runs)-1][1] = last
		} else {
			runs = append(runs, [2]uint64{first, last})
		}
	}
	if len(runs) > maxPatches {
		// The largest runs; joining distant ones would copy the clean
		// pages between them, the whole mapping in the worst case.
		slices.SortFunc(runs, func(a, b [2]uint64) int { return cmp.Compare(b[1]-b[0], a[1]-a[0]) })
		runs = runs[:maxPatches]
		slices.SortFunc(runs, func(a, b [2]uint64) int { return cmp.Compare(a[0], b[0]) })
	}
	out := make([]VMA, 0, len(runs))
	for _, r := range runs {
		out = append(out, VMA{
			Start: v.Start + r[0]*pageSize, End: v.Start + r[1]*pageSize,
			Prot: v.Prot, Flags: v.Flags, Pages: r[1] - r[0], Name: v.Name, Whole: true,
			Replaces: v.Name, ReplacesOffset: v.FileOffset + r[0]*pageSize,
		})
	}
	return out, nil
}

func parseKB(b []byte) uint64 {
	fs := bytes.Fields(b)
	if len(fs) == 0 {
		return 0
	}
	n, _ := strconv.ParseUint(string(fs[0]), 10, 64)
	return n
}

// parseHeader parses a maps line "start-end perms offset dev inode [name]".
// isHeader is false for smaps field lines; good says whether the VMA is a
// private anonymous mapping.
func parseHeader(l []byte) (v VMA, good, isHeader bool) {
	m, ok := splitMaps(l)
	if !ok {
		return v, false, false
	}
	v, good = m.vma()
	return v, good, true
}
