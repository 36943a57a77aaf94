package rehome

import (
	"bufio"
	"bytes"
	"fmt"
	"os"
	"strconv"

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
func Plan(pid int) ([]VMA, error) {
	f, err := os.Open(fmt.Sprintf("/proc/%d/smaps", pid))
	if err != nil {
		return nil, fmt.Errorf("rehome: process %d: %w", pid, errdefs.ErrNotFound)
	}
	defer f.Close()
	execFiles, err := executableFiles(pid)
	if err != nil {
		return nil, err
	}
	var out []VMA
	var cur VMA
	var ok bool // cur qualifies so far
	var kb, anonKB uint64
	sc := bufio.NewScanner(f)
	sc.Buffer(make([]byte, 64<<10), 1<<20)
	for sc.Scan() {
		l := sc.Bytes()
		if rest, found := bytes.CutPrefix(l, []byte("VmFlags:")); found {
			for _, fl := range bytes.Fields(rest) {
				if skipFlags[string(fl)] {
					ok = false
				}
				if string(fl) == "nr" {
					cur.Flags |= unix.MAP_NORESERVE
				}
			}
			if cur.Whole && anonKB == 0 {
				ok = false // clean .data: the file has its bytes already
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
			continue
		}
		if rest, found := bytes.CutPrefix(l, []byte("Anonymous:")); found {
			anonKB += parseKB(rest)
			continue
		}
		if rest, found := bytes.CutPrefix(l, []byte("Rss:")); found {
			kb += parseKB(rest)
			continue
		}
		if rest, found := bytes.CutPrefix(l, []byte("Swap:")); found {
			kb += parseKB(rest)
			continue
		}
		if v, good, isHeader := parseHeader(l); isHeader {
			cur, ok, kb, anonKB = v, good, 0, 0
			if !good && dataMapping(l, execFiles) {
				cur.Whole, ok = true, true
			}
		}
	}
	if err := sc.Err(); err != nil {
		return nil, fmt.Errorf("rehome: process %d: smaps: %w", pid, err)
	}
	return out, nil
}

// executableFiles are the (device, inode) of the files process pid maps
// executable: a program and its libraries.
func executableFiles(pid int) (map[string]bool, error) {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/maps", pid))
	if err != nil {
		return nil, fmt.Errorf("rehome: process %d: %w", pid, errdefs.ErrNotFound)
	}
	out := map[string]bool{}
	for l := range bytes.SplitSeq(b, []byte("\n")) {
		fs := bytes.Fields(l)
		if len(fs) >= 6 && len(fs[1]) == 4 && fs[1][2] == 'x' && string(fs[4]) != "0" {
			out[string(fs[3])+" "+string(fs[4])] = true
		}
	}
	return out, nil
}

// dataMapping reports whether a maps line is a program's or library's .data:
// private, writable, not executable, of a file the process maps executable.
func dataMapping(l []byte, execFiles map[string]bool) bool {
	fs := bytes.Fields(l)
	if len(fs) < 6 || len(fs[1]) != 4 || string(fs[1][1:]) != "w-p" || string(fs[4]) == "0" || fs[5][0] != '/' {
		return false
	}
	return execFiles[string(fs[3])+" "+string(fs[4])]
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
	fs := bytes.Fields(l)
	if len(fs) < 5 || bytes.IndexByte(fs[0], ':') >= 0 {
		return v, false, false
	}
	lo, hi, found := bytes.Cut(fs[0], []byte("-"))
	if !found {
		return v, false, false
	}
	s, err1 := strconv.ParseUint(string(lo), 16, 64)
	e, err2 := strconv.ParseUint(string(hi), 16, 64)
	if err1 != nil || err2 != nil || len(fs[1]) != 4 {
		return v, false, false
	}
	v.Start, v.End = s, e
	perms := fs[1]
	if perms[0] == 'r' {
		v.Prot |= unix.PROT_READ
	}
	if perms[1] == 'w' {
		v.Prot |= unix.PROT_WRITE
	}
	if perms[2] == 'x' {
		v.Prot |= unix.PROT_EXEC
	}
	if len(fs) > 5 {
		v.Name = string(bytes.Join(fs[5:], []byte(" ")))
	}
	anonName := v.Name == "" || v.Name == "[heap]" || bytes.HasPrefix([]byte(v.Name), []byte("[anon:"))
	good = perms[3] == 'p' && string(fs[4]) == "0" && anonName
	return v, good, true
}
