package movehelper

import (
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"time"

	"golang.org/x/sys/unix"

	"github.com/lazyfork/lazyfork/internal/procfs"
	"github.com/lazyfork/lazyfork/memfile/madvguard"
	"github.com/lazyfork/lazyfork/memfile/rehome"
)

// FileRange is a byte range of a memory file (memfile.FileRange, without
// memfile's weight in the helper).
type FileRange struct {
	File     string // base name in the family directory
	Off, Len uint64
}

// Request is what the shim asks the helper (JSON on stdin).
type Request struct {
	Freezer  string `json:"freezer"`  // the container's frozen cgroup
	Pids     []int  `json:"pids"`     // every process in it
	HostFile string `json:"hostFile"` // the memory file, writable, on the host
	Inside   string `json:"inside"`   // the same file as the processes see it
	Guard    bool   `json:"guard"`    // install the madvise guard on what moved
	Mode     int    `json:"mode"`     // madvguard.Mode of the guard
	Chunk    uint64 `json:"chunk"`    // bytes copied and mapped at a time
	MemDir   string `json:"memDir"`   // where the processes see memory files
	// Prepare asks for the first step of a consolidation instead of a move
	// (rehome.Fragments, rehome.PrepareRegions): the processes run, nothing
	// is seized. Each process with more than PrepareAbove pieces in
	// fragmented regions gets its regions copied into HostFile from the
	// files in HostDir (the family's files on the host), if all of them
	// fit in MaxBytes; Reply.Regions lists what was prepared.
	Prepare      bool   `json:"prepare,omitempty"`
	HostDir      string `json:"hostDir,omitempty"`
	PrepareAbove int    `json:"prepareAbove,omitempty"`
	// PrepareWritten, with Prepare: also regions of fewer pieces that hold
	// pages the process wrote (rehome.Fragments with private), for a
	// process that ran on its files without moving since its last move.
	PrepareWritten bool  `json:"prepareWritten,omitempty"`
	MaxBytes       int64 `json:"maxBytes,omitempty"`
	// Hop, with a move: regions prepared earlier, mapped from their file
	// (with the pages written since on top) before the move plans.
	Hop *Hop `json:"hop,omitempty"`
	// Preload marks a message sent ahead of the request, before the
	// freeze, to a helper waiting for it: Hop's regions (thousands of
	// pieces, some milliseconds to encode and decode), which the request's
	// Hop then names by Hop.Preloaded instead of carrying them.
	Preload bool `json:"preload,omitempty"`
	// PreCopy marks a message sent ahead of the request, while the
	// container runs: copy its private anonymous memory into HostFile now
	// (rehome.PreCopy; Freezer, Pids and MemDir as in a move), answer with
	// a Reply line (PreCopied bytes), and wait for the request, whose move
	// then copies only the pages written since. The helper is in the
	// container's memory cgroup while it copies.
	PreCopy bool `json:"preCopy,omitempty"`
	// MinBytes: a PreCopy is made only if the processes hold at least
	// this much private anonymous memory (0: MinPreCopy).
	MinBytes int64 `json:"minBytes,omitempty"`
	// PreCopied, with a move: HostFile may hold a precopy. A helper that
	// did not make it (another took its place) empties the file first.
	PreCopied bool `json:"preCopied,omitempty"`
	// Copies asks for byte copies instead of a move: each range of a file
	// into HostFile, written from the container's memory cgroup (a patched
	// snapshot's patches: memfile.PatchOptions.Copy). Nothing is seized.
	Copies []CopyRange `json:"copies,omitempty"`
	// ChargedTo is the memory cgroup the helper writes the file from (the
	// container's, unless it could not join it): not sent, for the record.
	ChargedTo string `json:"-"`
}

// CopyRange is Len bytes of file Src at SrcOff, to go to DstOff of the
// request's HostFile.
type CopyRange struct {
	Src    string `json:"src"`
	SrcOff int64  `json:"srcOff"`
	DstOff int64  `json:"dstOff"`
	Len    int64  `json:"len"`
}

// Hop is the second step of a consolidation: the prepared file and its
// regions.
type Hop struct {
	HostFile string   `json:"hostFile"`
	Inside   string   `json:"inside"`
	Regions  []Region `json:"regions"`
	// Preloaded: Regions are those of the Preload message before.
	Preloaded bool `json:"preloaded,omitempty"`
}

// Region is a prepared region of one process.
type Region struct {
	Pid int        `json:"pid"`
	VMA rehome.VMA `json:"vma"`
}

// Reply is the helper's answer (JSON on stdout).
type Reply struct {
	// Regions are the regions a Prepare copied (Prepared bytes).
	Regions  []Region `json:"regions,omitempty"`
	Prepared int64    `json:"prepared,omitempty"`
	// Hopped counts the regions a Hop mapped from its file; HopErr says
	// why others were not (they keep their mappings).
	// PreCopied is what a PreCopy copied (PreCopyVMAs VMAs, in PreCopy
	// time, of which Frozen with the container frozen); in a move's reply,
	// what the move took from it (PreCopiedVMAs VMAs, their pages written
	// since on top).
	PreCopied     int64         `json:"preCopied,omitempty"`
	PreCopyVMAs   int           `json:"preCopyVMAs,omitempty"`
	PreCopy       time.Duration `json:"preCopy,omitempty"`
	Frozen        time.Duration `json:"frozen,omitempty"`
	Protect       time.Duration `json:"protect,omitempty"`
	PreCopiedVMAs int           `json:"preCopiedVMAs,omitempty"`
	Hopped        int           `json:"hopped,omitempty"`
	HopBytes      int64         `json:"hopBytes,omitempty"` // written since the preparation, on top
	HopErr        string        `json:"hopErr,omitempty"`
	// Replaced are the ranges of older memory files whose pages the
	// processes no longer map (written since, now moved), for
	// Store.PunchUnused; only from a move that finished.
	Replaced []FileRange `json:"replaced,omitempty"`
	VMAs     int         `json:"vmas"`               // VMAs moved whole
	Patches  int         `json:"patches,omitempty"`  // of which patches of memory-file mappings (each splits one)
	Bytes    int64       `json:"bytes"`              // bytes written into the file
	ByTracer int64       `json:"byTracer,omitempty"` // of which the helper copied (sameMemoryCgroup, runs under 16 pages, or the process could not write them)
	Calls    int         `json:"calls"`              // pwrite calls the processes made
	Batched  int         `json:"batched,omitempty"`  // mmaps run in batches (rehome.CopyStats.Batched)
	// Where the helper's time went: seizing the tree, planning (reading
	// smaps and pagemaps), copying and mapping (Move), and installing
	// guards (Guard); Hop is a consolidation's whole step (its check, its
	// copying and mapping, also in Move, and its guard, also in Guard).
	Seize, Plan, Move, Hop, Guard time.Duration
	HopCheck                      time.Duration // of Hop, the regions' check (StillPrepared)
	Map                           time.Duration // of Move, the mmap calls injected into the processes
	// FilterErr: the processes' seccomp filters could not be read, so each
	// move guarded everything it moved with a filter of its own.
	FilterErr string `json:"filterErr,omitempty"`
	// Unguardable counts the VMAs (and prepared regions) left as they were
	// because the guard that would cover them no longer fits the
	// processes' seccomp filters (the kernel's bound): moved, they would
	// be unguarded.
	Unguardable int   `json:"unguardable,omitempty"`
	NoNewPrivs  []int `json:"noNewPrivs,omitempty"`
	// WipeOnFork holds, for each process the move planned (by pid; every
	// process of Pids up to a failed plan), its MADV_WIPEONFORK ranges
	// ([start, end), none for most): read with the plan, the dump needs
	// no second read of the frozen tree's smaps (memfile.WipeOnFork).
	WipeOnFork map[int][][2]uint64 `json:"wipeOnFork,omitempty"`
	Err        string              `json:"err,omitempty"`
}

// Run is the helper's side: read a Request from stdin, seize the frozen
// container, move each process onto the file, guard what moved, let go, and
// write the Reply to stdout.
func Run(stdin io.Reader, stdout io.Writer) error {
	dec := json.NewDecoder(stdin)
	var pre *preCopied
	defer func() { pre.discard(nil) }()
	req, err := readRequest(dec, func(r *Request) error {
		pre.discard(nil) // one at a time
		var reply Reply
		pre, reply = preCopy(r)
		return json.NewEncoder(stdout).Encode(reply)
	})
	if err != nil {
		return err
	}
	// stdin closes once the shim has put this process into the container's
	// memory cgroup.
	joined := sync.OnceFunc(func() { io.Copy(io.Discard, io.MultiReader(dec.Buffered(), stdin)) })
	var reply Reply
	switch {
	case len(req.Copies) > 0:
		reply = copyRanges(&req, joined)
	case req.Prepare:
		reply = prepare(&req, joined)
	default:
		reply = moveAll(&req, joined, pre)
		pre = nil
	}
	// Not before the shim is done with this process's pid, even when
	// nothing moved.
	joined()
	return json.NewEncoder(stdout).Encode(reply)
}

// readRequest reads the request, after the Preload messages before it (the
// last one's regions stand for the request's Hop.Preloaded) and the PreCopy
// ones, each handed to preCopy as it comes.
func readRequest(dec *json.Decoder, preCopy func(*Request) error) (Request, error) {
	var preloaded []Region
	for {
		var req Request
		if err := dec.Decode(&req); err != nil {
			return req, fmt.Errorf("decode request: %w", err)
		}
		if req.PreCopy {
			if err := preCopy(&req); err != nil {
				return req, fmt.Errorf("precopy reply: %w", err)
			}
			continue
		}
		if req.Preload {
			if req.Hop != nil {
				preloaded = req.Hop.Regions
			}
			continue
		}
		if req.Hop != nil && req.Hop.Preloaded {
			if preloaded == nil {
				return req, errors.New("the request names preloaded regions, and none came before it")
			}
			req.Hop.Regions = preloaded
		}
		return req, nil
	}
}

// moveAll moves the tree of req; joined returns once the helper is in the
// container's memory cgroup, and is called before anything is written.
func moveAll(req *Request, joined func(), pre *preCopied) (reply Reply) {
	fail := func(err error) Reply { reply.Err = err.Error(); return reply }
	f, err := os.OpenFile(req.HostFile, os.O_RDWR, 0)
	if err != nil {
		pre.discard(nil)
		return fail(err)
	}
	defer f.Close()
	t0 := time.Now()
	tr, err := rehome.Seize(req.Freezer, req.Pids...)
	if err != nil {
		pre.discard(nil)
		if req.PreCopied {
			err = errors.Join(err, f.Truncate(0))
		}
		return fail(err)
	}
	reply.Seize = time.Since(t0)
	// A precopy of this file is used, every process stopped; any other
	// copy in it (a precopy another helper made) goes.
	pre, err = pre.finish(f)
	if err != nil {
		tr.Detach()
		return fail(err)
	}
	if pre == nil && req.PreCopied {
		if err := f.Truncate(0); err != nil {
			tr.Detach()
			return fail(fmt.Errorf("drop a precopy: %w", err))
		}
	}
	applied := map[int]bool{}
	var errs []error
	defer func() {
		if err := tr.Detach(); err != nil {
			errs = append(errs, fmt.Errorf("detach: %w", err))
		}
		reply.NoNewPrivs = tr.NoNewPrivs
		if err := errors.Join(errs...); err != nil {
			reply.Err = err.Error()
		}
	}()
	// guard installs the madvise guard (req.Guard) on what moved. Without
	// it a purge there would bring back the file's bytes where the
	// allocator expects zeros: its failure is the move's.
	guard := func(pid int, done []rehome.VMA) error {
		if !req.Guard || len(done) == 0 {
			return nil
		}
		defer func(t0 time.Time) { reply.Guard += time.Since(t0) }(time.Now())
		ranges := make([]madvguard.Range, len(done))
		for i, v := range done {
			ranges[i] = madvguard.Range{Start: v.Start, End: v.End}
		}
		// Patches and consolidated regions lie in memory its guards
		// cover already: only what none covers gets a filter, or one per
		// move would stack up to the kernel's limit. (Unreadable filters:
		// all of it, and the reason reported.)
		if chains, err := tr.Filters(pid); err != nil {
			reply.FilterErr = err.Error()
		} else if ranges = madvguard.Uncovered(chains, madvguard.Mode(req.Mode), ranges); len(ranges) == 0 {
			return nil
		}
		prog, err := madvguard.Program(ranges, madvguard.Mode(req.Mode))
		if err == nil {
			err = tr.InstallFilter(pid, prog)
		}
		if err != nil {
			return fmt.Errorf("process %d: madvise guard: %w", pid, err)
		}
		return nil
	}
	var hop *os.File
	if req.Hop != nil && len(req.Hop.Regions) > 0 {
		if hop, err = os.OpenFile(req.Hop.HostFile, os.O_RDWR, 0); err != nil {
			reply.HopErr = err.Error()
		} else {
			defer hop.Close()
		}
	}
	slot := pre.slotsUsed()
	defer func() {
		// Precopied processes gone or not planned: their slots go. The
		// userfaultfds close once the VMAs they protect are replaced.
		for _, pc := range pre.all() {
			if !applied[pc.Pid] {
				if err := pc.Drop(f); err != nil {
					errs = append(errs, err)
				}
			}
			pc.Close()
		}
	}()
	for _, pid := range req.Pids {
		if hop != nil {
			// Prepared regions first: the plan below then finds no
			// written page in them to patch.
			var regions []rehome.VMA
			for _, r := range req.Hop.Regions {
				if r.Pid == pid {
					regions = append(regions, r.VMA)
				}
			}
			t1 := time.Now()
			if len(regions) > 0 {
				// Each region on its own: one changed since its
				// preparation (or locked, registered, sealed meanwhile)
				// stays as it is; the others go ahead.
				n := len(regions)
				regions, err = rehome.StillPrepared(pid, regions)
				reply.HopCheck += time.Since(t1)
				if err != nil {
					reply.HopErr = fmt.Sprintf("process %d: %v", pid, err)
					regions = nil
				} else if len(regions) < n {
					reply.HopErr = fmt.Sprintf("process %d: %d of %d prepared regions changed since their preparation", pid, n-len(regions), n)
				}
			}
			if n := len(regions); req.Guard && n > 0 {
				// Its file data where the old files had holes needs a
				// guard (below) that must fit, as a move's.
				regions = guardable(tr, pid, madvguard.Mode(req.Mode), regions)
				reply.Unguardable += n - len(regions)
			}
			if len(regions) > 0 {
				joined()
				tr.TracerCopies = sameMemoryCgroup(pid)
				t2 := time.Now()
				done, cs, err := tr.MoveFile(pid, hop, req.Hop.Inside, regions, req.Chunk)
				reply.Move += time.Since(t2)
				reply.Map += cs.Map
				reply.Calls += cs.Calls
				reply.Batched += cs.Batched
				reply.HopBytes += cs.Bytes
				reply.Hopped += len(done)
				for _, v := range done {
					for _, p := range v.Pieces {
						reply.Replaced = append(reply.Replaced, FileRange{File: filepath.Base(p.Path), Off: p.Offset, Len: p.End - p.Start})
					}
				}
				if err != nil {
					// The regions not done keep their mappings; the
					// move goes on.
					reply.HopErr = fmt.Sprintf("process %d: %v", pid, err)
				}
				// What a consolidation mapped holds, as file data, pages
				// that were holes (zeros) of the files it replaced, which
				// no guard of a restored fork covers: guarded like a move.
				if err := guard(pid, done); err != nil {
					errs = append(errs, err)
				}
			}
			reply.Hop += time.Since(t1)
		}
		// Written pages inside mappings of memory files are planned too:
		// after a move, nothing the processes wrote stays private.
		t1 := time.Now()
		var wiped [][2]uint64
		opts := rehome.PlanOptions{MemDir: req.MemDir, WipeOnFork: func(start, end uint64) {
			wiped = append(wiped, [2]uint64{start, end})
		}}
		if pc := pre.of(pid); pc != nil {
			opts.WriteProtected = pc.Protects
		}
		vmas, err := rehome.PlanWith(pid, opts)
		reply.Plan += time.Since(t1)
		if err != nil {
			errs = append(errs, err)
			return reply
		}
		if reply.WipeOnFork == nil {
			reply.WipeOnFork = map[int][][2]uint64{}
		}
		reply.WipeOnFork[pid] = wiped
		if n := len(vmas); req.Guard && n > 0 {
			vmas = guardable(tr, pid, madvguard.Mode(req.Mode), vmas)
			reply.Unguardable += n - len(vmas)
		}
		// One file for the tree: each process's VMAs in slots of their own
		// (a precopy's where they are the same mappings).
		if pc := pre.of(pid); pc != nil {
			if vmas, err = pc.Apply(vmas, f, &slot); err != nil {
				errs = append(errs, err)
				return reply
			}
			applied[pid] = true
			for _, v := range vmas {
				if v.PreCopied {
					reply.PreCopiedVMAs++
				}
			}
		} else {
			used := slotsUsed(vmas)
			for i := range vmas {
				vmas[i].Slot += slot
			}
			slot += used
		}
		if len(vmas) == 0 {
			continue
		}
		joined()
		tr.TracerCopies = sameMemoryCgroup(pid)
		if fp := os.Getenv("LAZYFORK_REHOME_FAILPOINT"); (fp == "die-mid-move" || fp == "hang-mid-move") && len(vmas) > 1 {
			// Tests: the helper killed, or hanging, with part of the tree
			// moved.
			tr.MoveFile(pid, f, req.Inside, vmas[:1], req.Chunk)
			for fp == "hang-mid-move" {
				time.Sleep(time.Hour)
			}
			unix.Kill(os.Getpid(), unix.SIGKILL)
		}
		t2 := time.Now()
		done, cs, err := tr.MoveFile(pid, f, req.Inside, vmas, req.Chunk)
		reply.Move += time.Since(t2)
		reply.Map += cs.Map
		reply.Calls += cs.Calls
		reply.Batched += cs.Batched
		reply.VMAs += len(done)
		for _, v := range done {
			if v.Replaces != "" {
				reply.Patches++
				reply.Replaced = append(reply.Replaced, FileRange{
					File: filepath.Base(strings.TrimSuffix(v.Replaces, " (deleted)")), Off: v.ReplacesOffset, Len: v.Len()})
			}
		}
		reply.Bytes += cs.Bytes
		reply.ByTracer += cs.ByTracer
		if err != nil {
			errs = append(errs, fmt.Errorf("process %d: %w", pid, err))
		}
		if err := guard(pid, done); err != nil {
			errs = append(errs, err)
		}
	}
	return reply
}

// guardable returns the VMAs of vmas that a move may take: all of them, unless
// the guard their move needs (for what no guard covers yet: new memory; a
// heap that grows between moves adds one filter a move) would pass the
// kernel's bound on process pid's filters. Then what only that guard would
// cover stays where it is, anonymous, which is always correct; patches of
// guarded mappings still move. Filters it cannot read: all of them (guard
// reports why).
func guardable(tr *rehome.Tracee, pid int, mode madvguard.Mode, vmas []rehome.VMA) []rehome.VMA {
	chains, err := tr.Filters(pid)
	if err != nil {
		return vmas
	}
	ranges := make([]madvguard.Range, len(vmas))
	for i, v := range vmas {
		ranges[i] = madvguard.Range{Start: v.Start, End: v.End}
	}
	unc := madvguard.Uncovered(chains, mode, ranges)
	if len(unc) == 0 {
		return vmas
	}
	if prog, err := madvguard.Program(unc, mode); err == nil && madvguard.Fits(chains, prog) {
		return vmas
	}
	return slices.DeleteFunc(vmas, func(v rehome.VMA) bool {
		return slices.ContainsFunc(unc, func(r madvguard.Range) bool { return r.Start < v.End && v.Start < r.End })
	})
}

// MinRegionPieces is the fewest mappings a region needs to be consolidated.
const MinRegionPieces = 16

// prepare is the first step of a consolidation (Request.Prepare).
func prepare(req *Request, joined func()) (reply Reply) {
	fail := func(err error) Reply { reply.Err = err.Error(); return reply }
	type plan struct {
		pid     int
		regions []rehome.VMA
	}
	var plans []plan
	var bytes uint64
	slot := 0
	for _, pid := range req.Pids {
		all, err := rehome.Fragments(pid, req.MemDir, req.PrepareWritten)
		if err != nil {
			return fail(err)
		}
		// A few adjacent mappings are what any move leaves (each VMA in
		// its own slot): only regions patches cut up are worth a copy.
		var regions []rehome.VMA
		for _, r := range all {
			if len(r.Pieces) >= MinRegionPieces || req.PrepareWritten && r.HoldsPrivate {
				r.Slot = len(regions)
				regions = append(regions, r)
			}
		}
		if rehome.Pieces(regions) <= req.PrepareAbove {
			continue
		}
		for i := range regions {
			regions[i].Slot += slot
			bytes += regions[i].Len()
		}
		slot += len(regions)
		plans = append(plans, plan{pid, regions})
	}
	if len(plans) == 0 {
		return reply
	}
	if req.MaxBytes > 0 && bytes > uint64(req.MaxBytes) {
		return fail(fmt.Errorf("consolidating %d MiB of fragmented mappings needs more than the %d MiB of headroom under the memory limit", bytes>>20, req.MaxBytes>>20))
	}
	f, err := os.OpenFile(req.HostFile, os.O_RDWR, 0)
	if err != nil {
		return fail(err)
	}
	defer f.Close()
	joined() // the copy is charged to the container
	var errs []error
	for _, p := range plans {
		done, n, err := rehome.PrepareRegions(p.regions, req.HostDir, f)
		reply.Prepared += n
		for _, v := range done {
			reply.Regions = append(reply.Regions, Region{Pid: p.pid, VMA: v})
		}
		if err != nil {
			errs = append(errs, fmt.Errorf("process %d: %w", p.pid, err))
		}
	}
	if err := errors.Join(errs...); err != nil {
		reply.Err = err.Error()
	}
	return reply
}

// sameMemoryCgroup says whether the helper runs in process pid's memory
// cgroup. There it copies the pages itself (rehome.Tracee.TracerCopies:
// several times faster than the process's own pwrite on some hypervisors,
// and charged to the same cgroup); elsewhere (cgroup v2, where the
// container's cgroup is frozen, or a join that failed) the process writes
// them, so that they are charged to it.
func sameMemoryCgroup(pid int) bool {
	mine, _, err := procfs.Cgroup(os.Getpid(), "memory")
	if err != nil {
		return false
	}
	theirs, _, err := procfs.Cgroup(pid, "memory")
	return err == nil && mine == theirs
}

// slotsUsed is the number of slots a process's planned VMAs take: past the
// highest, not their count, since guardable may have dropped some (their
// slots stay unused; the next process's must not overlap the rest).
func slotsUsed(vmas []rehome.VMA) int {
	n := 0
	for _, v := range vmas {
		n = max(n, v.Slot+1)
	}
	return n
}

// copyRanges copies req.Copies into req.HostFile once the helper is in the
// container's memory cgroup (Request.Copies).
func copyRanges(req *Request, joined func()) (reply Reply) {
	dst, err := os.OpenFile(req.HostFile, os.O_WRONLY, 0)
	if err != nil {
		reply.Err = err.Error()
		return reply
	}
	defer dst.Close()
	srcs := map[string]*os.File{}
	defer func() {
		for _, f := range srcs {
			f.Close()
		}
	}()
	joined() // what it writes is charged to the container
	for _, c := range req.Copies {
		src := srcs[c.Src]
		if src == nil {
			if src, err = os.Open(c.Src); err != nil {
				reply.Err = err.Error()
				return reply
			}
			srcs[c.Src] = src
		}
		in, out := c.SrcOff, c.DstOff
		for n := c.Len; n > 0; {
			w, err := unix.CopyFileRange(int(src.Fd()), &in, int(dst.Fd()), &out, int(n), 0)
			if err != nil || w == 0 {
				reply.Err = fmt.Sprintf("copy %s at %d into %s at %d: %v (copied %d of %d)", c.Src, in, req.HostFile, out, err, c.Len-n, c.Len)
				return reply
			}
			n -= int64(w)
			reply.Bytes += int64(w)
		}
	}
	return reply
}
