package memfile

import (
	"bufio"
	"bytes"
	"fmt"
	"os"
	"slices"
	"strconv"

	"github.com/lazyfork/lazyfork/internal/procfs"
)

// Range is the address range [Start, End) of a VMA.
type Range struct{ Start, End uint64 }

// WipeOnFork maps each process of a dump, by the pid its images carry (the
// pid in the process's own PID namespace), to the ranges it had marked
// MADV_WIPEONFORK.
//
// CRIU neither records nor restores that advice, so every copy would start
// with the same bytes there. The kernel wipes such memory in a fork() child
// because it holds state that must never be shared by two processes: the
// vDSO getrandom state of Go ≥1.24 and glibc ≥2.41 lives there, and two
// copies restored with it draw the same "random" numbers. A rewrite given
// these ranges drops their pages (the copy reads zeros, as a fork() child
// does, and the vDSO reseeds from the kernel) and restores the advice.
type WipeOnFork map[uint32][]Range

// Merge adds o's ranges to w (w may be nil) and returns it.
func (w WipeOnFork) Merge(o WipeOnFork) WipeOnFork {
	if w == nil && len(o) > 0 {
		w = WipeOnFork{}
	}
	for pid, rs := range o {
		for _, r := range rs {
			if !slices.Contains(w[pid], r) {
				w[pid] = append(w[pid], r)
			}
		}
	}
	return w
}

// covers reports whether [start, end) lies inside one of pid's ranges. A VMA
// read before a dump may since have merged with a neighbour of the same
// kind, so containment, not equality, is what counts.
func (w WipeOnFork) covers(pid uint32, start, end uint64) bool {
	for _, r := range w[pid] {
		if r.Start <= start && end <= r.End {
			return true
		}
	}
	return false
}

// ReadWipeOnFork reads, from /proc, the MADV_WIPEONFORK ranges of the process
// tree rooted at the (host) pid root. Call it while the tree is frozen, or
// just before and after a leave-running dump and merge the two: the smaps of
// a process are the only place the kernel shows the advice. A process that
// exits meanwhile is skipped; a root that is gone is an error.
func ReadWipeOnFork(root int) (WipeOnFork, error) {
	pids, err := procfs.Tree(root)
	if err != nil {
		return nil, err
	}
	w := WipeOnFork{}
	for i, pid := range pids {
		nspid, ranges, err := readSmapsWipe(pid)
		if err != nil {
			if i == 0 {
				return nil, err
			}
			continue
		}
		if len(ranges) > 0 {
			w[nspid] = ranges
		}
	}
	return w, nil
}

// WipeOnForkOf is ReadWipeOnFork from ranges read already, by host pid
// (a move's plan, which reads each process's smaps while the tree is
// frozen): ok is false, and the caller reads them itself, unless every
// process of the tree rooted at root is there.
func WipeOnForkOf(root int, byPid map[int][][2]uint64) (w WipeOnFork, ok bool) {
	pids, err := procfs.Tree(root)
	if err != nil {
		return nil, false
	}
	w = WipeOnFork{}
	for _, pid := range pids {
		rs, planned := byPid[pid]
		if !planned {
			return nil, false
		}
		if len(rs) == 0 {
			continue
		}
		nspid, err := procfs.NSPID(pid)
		if err != nil {
			return nil, false
		}
		for _, r := range rs {
			w[uint32(nspid)] = append(w[uint32(nspid)], Range{r[0], r[1]})
		}
	}
	return w, true
}

// readSmapsWipe returns pid's pid in its own namespace and its wipe-on-fork
// ranges.
func readSmapsWipe(pid int) (uint32, []Range, error) {
	nspid, err := procfs.NSPID(pid)
	if err != nil {
		return 0, nil, err
	}
	f, err := os.Open(fmt.Sprintf("/proc/%d/smaps", pid))
	if err != nil {
		return 0, nil, fmt.Errorf("process %d: %w", pid, err)
	}
	defer f.Close()
	var out []Range
	var cur Range
	sc := bufio.NewScanner(f)
	sc.Buffer(make([]byte, 64<<10), 1<<20)
	for sc.Scan() {
		l := sc.Bytes()
		if rest, ok := bytes.CutPrefix(l, []byte("VmFlags:")); ok {
			for _, fl := range bytes.Fields(rest) {
				if string(fl) == "wf" {
					out = append(out, cur)
					break
				}
			}
			continue
		}
		// A VMA's header line starts "start-end "; field lines "Name: ".
		sp := bytes.IndexByte(l, ' ')
		if sp < 0 || bytes.IndexByte(l[:sp], ':') >= 0 {
			continue
		}
		lo, hi, ok := bytes.Cut(l[:sp], []byte("-"))
		if !ok {
			continue
		}
		s, err1 := strconv.ParseUint(string(lo), 16, 64)
		e, err2 := strconv.ParseUint(string(hi), 16, 64)
		if err1 == nil && err2 == nil {
			cur = Range{s, e}
		}
	}
	if err := sc.Err(); err != nil {
		return 0, nil, fmt.Errorf("process %d: smaps: %w", pid, err)
	}
	return uint32(nspid), out, nil
}
