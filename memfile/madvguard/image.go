package madvguard

import (
	"bytes"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"sort"

	criucore "github.com/checkpoint-restore/go-criu/v7/crit/images/criu-core"
	"github.com/checkpoint-restore/go-criu/v7/crit/images/seccomp"
	"github.com/containerd/errdefs"
	"golang.org/x/sys/unix"
	"google.golang.org/protobuf/proto"

	"github.com/lazyfork/lazyfork/criuimg"
	"github.com/lazyfork/lazyfork/internal/atomicfile"
)

// CRIU task states (compel/include/uapi/task-state.h).
const (
	taskAlive   = 1
	taskStopped = 3
)

// writeImage replaces path with img, never in place: a staging copy of an
// image may share the old file's inode with the original (hard links).
func writeImage(path string, img *criuimg.Image) error {
	data, err := img.Bytes()
	if err != nil {
		return err
	}
	return writeAtomic(path, data)
}

// writeAtomic replaces path with data (temp file, fsync, rename), keeping
// the old file's mode.
func writeAtomic(path string, data []byte) error {
	mode := fs.FileMode(0o600)
	if st, err := os.Stat(path); err == nil {
		mode = st.Mode().Perm()
	}
	return atomicfile.WriteFile(path, data, mode)
}

// process is one live process of the image with its threads' cores.
type process struct {
	pid     int
	tids    []int
	cores   []*criucore.CoreEntry
	imgs    []*criuimg.Image // core image of each thread (one entry)
	changed []bool
}

type filter struct {
	data  []byte
	flags uint32
}

type imageState struct {
	dir   string
	procs []*process
	secc  *seccomp.SeccompEntry
	sImg  *criuimg.Image // nil when the dump has no seccomp.img
}

// deadTask reports whether the task whose leader is pid was dumped dead (a
// zombie) or as a helper: neither restores seccomp state.
func deadTask(dir string, pid uint32) (bool, error) {
	path := criuimg.CorePath(dir, pid)
	cimg, err := criuimg.ReadImage(path, criuimg.MagicCore, criuimg.Of(&criucore.CoreEntry{}))
	if err != nil {
		return false, fmt.Errorf("madvguard: %v: %w", err, errdefs.ErrInvalidArgument)
	}
	if len(cimg.Entries) != 1 {
		return false, fmt.Errorf("%s: %d entries, want 1: %w", path, len(cimg.Entries), errdefs.ErrInvalidArgument)
	}
	s := cimg.Entries[0].(*criucore.CoreEntry).GetTc().GetTaskState()
	return s != taskAlive && s != taskStopped, nil
}

func load(dir string) (*imageState, error) {
	st := &imageState{dir: dir}
	entries, err := criuimg.ReadPstree(dir)
	if err != nil {
		if errors.Is(err, errdefs.ErrNotFound) {
			return nil, fmt.Errorf("%s is not a CRIU image directory (no pstree.img): %w", dir, errdefs.ErrNotFound)
		}
		return nil, fmt.Errorf("madvguard: %v: %w", err, errdefs.ErrInvalidArgument)
	}
	for _, pe := range entries {
		p := &process{pid: int(pe.GetPid())}
		// The leader's state first: a zombie restores no seccomp state, and
		// CRIU 4.1.1 leaves a dead task's thread ids unset (garbage, with no
		// core image behind them).
		if dead, err := deadTask(dir, uint32(p.pid)); err != nil {
			return nil, err
		} else if dead {
			continue
		}
		for _, t := range pe.GetThreads() {
			p.tids = append(p.tids, int(t))
		}
		if len(p.tids) == 0 {
			p.tids = []int{p.pid}
		}
		live := true
		for _, tid := range p.tids {
			path := criuimg.CorePath(dir, uint32(tid))
			cimg, err := criuimg.ReadImage(path, criuimg.MagicCore, criuimg.Of(&criucore.CoreEntry{}))
			if err != nil {
				return nil, fmt.Errorf("madvguard: %v: %w", err, errdefs.ErrInvalidArgument)
			}
			if len(cimg.Entries) != 1 {
				return nil, fmt.Errorf("%s: %d entries, want 1: %w", path, len(cimg.Entries), errdefs.ErrInvalidArgument)
			}
			core := cimg.Entries[0].(*criucore.CoreEntry)
			if tid == p.pid {
				if s := core.GetTc().GetTaskState(); s != taskAlive && s != taskStopped {
					live = false // zombies and helpers restore no seccomp state
					break
				}
				if core.GetTc().OldSeccompMode != nil {
					return nil, fmt.Errorf("%s: pre-3.x per-task seccomp fields: %w", path, errdefs.ErrNotImplemented)
				}
			}
			if core.GetThreadCore() == nil {
				return nil, fmt.Errorf("%s: no thread core: %w", path, errdefs.ErrInvalidArgument)
			}
			p.cores = append(p.cores, core)
			p.imgs = append(p.imgs, cimg)
		}
		if live {
			p.changed = make([]bool, len(p.tids))
			st.procs = append(st.procs, p)
		}
	}
	simg, err := criuimg.ReadImage(filepath.Join(dir, "seccomp.img"), criuimg.MagicSeccomp, criuimg.Of(&seccomp.SeccompEntry{}))
	switch {
	case errors.Is(err, errdefs.ErrNotFound):
		st.secc = &seccomp.SeccompEntry{}
	case err != nil:
		return nil, fmt.Errorf("madvguard: %v: %w", err, errdefs.ErrInvalidArgument)
	case len(simg.Entries) > 1:
		return nil, fmt.Errorf("seccomp.img: %d entries, want at most 1: %w", len(simg.Entries), errdefs.ErrInvalidArgument)
	default:
		st.sImg = simg
		st.secc = &seccomp.SeccompEntry{}
		if len(simg.Entries) == 1 {
			st.secc = simg.Entries[0].(*seccomp.SeccompEntry)
		}
	}
	return st, nil
}

// chain returns a thread's filters oldest first (CRIU stores the newest
// index in the core and links each filter to the one before it).
func (st *imageState) chain(core *criucore.CoreEntry) ([]filter, error) {
	tc := core.GetThreadCore()
	if tc.GetSeccompMode() != criucore.SeccompMode_filter {
		return nil, nil
	}
	fs := st.secc.GetSeccompFilters()
	var out []filter
	seen := map[uint32]bool{}
	for i, more := tc.GetSeccompFilter(), true; more; {
		if int(i) >= len(fs) || seen[i] {
			return nil, fmt.Errorf("seccomp.img: broken filter chain at index %d: %w", i, errdefs.ErrInvalidArgument)
		}
		seen[i] = true
		f := fs[i]
		out = append(out, filter{data: f.GetFilter(), flags: f.GetFlags()})
		i, more = f.GetPrev(), f.Prev != nil
	}
	slices.Reverse(out)
	return out, nil
}

// Thread is the seccomp state of one thread as the image records it.
type Thread struct {
	Pid, Tid int
	Filters  int     // filters in its chain, ours included
	Guards   int     // how many of them are madvise guards
	TSync    bool    // its filters are installed with SECCOMP_FILTER_FLAG_TSYNC
	Ranges   []Range // ranges of its guard(s)
	Mode     Mode    // mode of its (last) guard
}

// Inspect lists every live thread's seccomp state in an image. Threads
// whose chain CRIU folded into the leader's (TSYNC) show no filters.
func Inspect(imageDir string) ([]Thread, error) {
	st, err := load(imageDir)
	if err != nil {
		return nil, err
	}
	var out []Thread
	for _, p := range st.procs {
		for i, core := range p.cores {
			ch, err := st.chain(core)
			if err != nil {
				return nil, err
			}
			t := Thread{Pid: p.pid, Tid: p.tids[i], Filters: len(ch)}
			for _, f := range ch {
				t.TSync = t.TSync || f.flags&unix.SECCOMP_FILTER_FLAG_TSYNC != 0
				if isGuard(f.data) {
					t.Guards++
					rs, mode, err := guardRanges(f.data)
					if err != nil {
						return nil, err
					}
					t.Mode = mode
					t.Ranges = append(t.Ranges, rs...)
				}
			}
			out = append(out, t)
		}
	}
	return out, nil
}

// Installed reports whether any thread of the image carries a guard.
func Installed(imageDir string) (bool, error) {
	ts, err := Inspect(imageDir)
	if err != nil {
		return false, err
	}
	for _, t := range ts {
		if t.Guards > 0 {
			return true, nil
		}
	}
	return false, nil
}

// Apply is ApplyMode with Refuse.
func Apply(imageDir string, ranges map[int][]Range) error {
	return ApplyMode(imageDir, ranges, Refuse)
}

// ApplyMode makes the image's guard for each process match ranges (keyed by the
// pid the image records, as in pstree.img): a process listed with ranges gets
// exactly one guard on top of its own filters, on every thread; a process
// not listed, or listed with none, loses any guard a previous generation
// left. ranges must name every rewritten range of the process that holds
// data (of this and earlier generations), not only new ones.
func ApplyMode(imageDir string, ranges map[int][]Range, mode Mode) error {
	st, err := load(imageDir)
	if err != nil {
		return err
	}
	known := map[int]bool{}
	for _, p := range st.procs {
		known[p.pid] = true
	}
	var pids []int
	for pid := range ranges {
		pids = append(pids, pid)
	}
	sort.Ints(pids)
	for _, pid := range pids {
		if !known[pid] {
			return fmt.Errorf("madvguard: pid %d is not a live process of %s: %w", pid, imageDir, errdefs.ErrNotFound)
		}
	}
	for _, pid := range pids {
		for _, r := range ranges[pid] {
			if r.End < r.Start {
				return fmt.Errorf("madvguard: pid %d: range %v ends before it starts: %w", pid, r, errdefs.ErrInvalidArgument)
			}
		}
	}

	// New filters go after every existing one, so the current cores stay
	// valid until each is replaced.
	filters := slices.Clone(st.secc.GetSeccompFilters())
	grown := false
	for _, p := range st.procs {
		var guard []byte
		if rs := Compact(ranges[p.pid]); len(rs) > 0 {
			prog, err := Program(rs, mode)
			if err != nil {
				return fmt.Errorf("madvguard: pid %d: %w", p.pid, err)
			}
			guard = encode(prog)
		}
		chains := make([][]filter, len(p.cores))
		for i, core := range p.cores {
			if chains[i], err = st.chain(core); err != nil {
				return fmt.Errorf("core-%d.img: %w", p.tids[i], err)
			}
		}
		// CRIU's TSYNC form: the leader carries the chain with the TSYNC
		// flag and the other threads none; the kernel then gives every
		// thread the leader's filters. A process with no filters at all
		// takes the same form. Otherwise each thread keeps its own chain.
		// A thread in strict mode keeps it: a filter would turn it into
		// filter mode (what the restored thread reports in /proc), and
		// strict mode kills it at any madvise anyway. TSYNC would fail on
		// it, so its process takes the per-thread form.
		strict := make([]bool, len(p.cores))
		anyStrict := false
		for i, core := range p.cores {
			strict[i] = core.GetThreadCore().GetSeccompMode() == criucore.SeccompMode_strict
			anyStrict = anyStrict || strict[i]
		}
		tsync := !anyStrict
		for i, ch := range chains {
			if i == 0 {
				tsync = tsync && (len(ch) == 0 || ch[len(ch)-1].flags&unix.SECCOMP_FILTER_FLAG_TSYNC != 0)
			} else if len(ch) != 0 {
				tsync = false
			}
		}
		for i, core := range p.cores {
			if tsync && i > 0 || strict[i] {
				continue
			}
			var want []filter
			for _, f := range chains[i] {
				if !isGuard(f.data) {
					want = append(want, f)
				}
			}
			if guard != nil {
				var flags uint32
				if tsync {
					flags = unix.SECCOMP_FILTER_FLAG_TSYNC
				}
				want = append(want, filter{data: guard, flags: flags})
			}
			if slices.EqualFunc(want, chains[i], func(a, b filter) bool {
				return a.flags == b.flags && bytes.Equal(a.data, b.data)
			}) {
				continue
			}
			tc := core.GetThreadCore()
			if len(want) == 0 {
				tc.SeccompMode, tc.SeccompFilter = nil, nil
			} else {
				for j, f := range want {
					nf := &seccomp.SeccompFilter{Filter: f.data, Flags: proto.Uint32(f.flags)}
					if j > 0 {
						nf.Prev = proto.Uint32(uint32(len(filters) - 1))
					}
					filters = append(filters, nf)
				}
				grown = true
				tc.SeccompMode = criucore.SeccompMode_filter.Enum()
				tc.SeccompFilter = proto.Uint32(uint32(len(filters) - 1))
			}
			p.changed[i] = true
		}
	}

	if grown {
		simg := st.sImg
		if simg == nil {
			simg = &criuimg.Image{Head: criuimg.MagicCommon, Magic: criuimg.MagicSeccomp}
		}
		simg.Entries = []proto.Message{&seccomp.SeccompEntry{SeccompFilters: filters}}
		if err := writeImage(filepath.Join(imageDir, "seccomp.img"), simg); err != nil {
			return fmt.Errorf("madvguard: write seccomp.img: %w", err)
		}
	}
	for _, p := range st.procs {
		for i, core := range p.cores {
			if !p.changed[i] {
				continue
			}
			p.imgs[i].Entries = []proto.Message{core}
			if err := writeImage(criuimg.CorePath(imageDir, uint32(p.tids[i])), p.imgs[i]); err != nil {
				return fmt.Errorf("madvguard: write core-%d.img: %w", p.tids[i], err)
			}
		}
	}
	return nil
}
