package movehelper

import (
	"cmp"
	"errors"
	"fmt"
	"os"
	"time"

	"golang.org/x/sys/unix"

	"github.com/lazyfork/lazyfork/internal/freezer"
	"github.com/lazyfork/lazyfork/memfile/rehome"
)

// MinPreCopy is the least private anonymous memory a container holds for a
// precopy to be made, unless the request says (Request.MinBytes): below it,
// the move's copy in the pause is short, and a precopy adds about as much to
// the call.
const MinPreCopy = 128 << 20

// preCopied is the precopy a helper made (Request.PreCopy) and keeps for the
// move: the file it wrote and each process's copy (with its userfaultfd,
// which must stay open until the move).
type preCopied struct {
	file *os.File
	pcs  []*rehome.PreCopy
}

// preCopy makes the precopy of req: the container is frozen for the
// injection of a userfaultfd into each process (a few milliseconds, unless
// it was frozen already), then copied while it runs.
func preCopy(req *Request) (*preCopied, Reply) {
	var reply Reply
	t0 := time.Now()
	fail := func(err error) (*preCopied, Reply) {
		reply.Err = err.Error()
		reply.PreCopy = time.Since(t0)
		return nil, reply
	}
	f, err := os.OpenFile(req.HostFile, os.O_RDWR, 0)
	if err != nil {
		return fail(err)
	}
	pre := &preCopied{file: f}
	// Planned first, while the processes run (a VMA that changes before
	// the move loses its copy then: PreCopy.Apply): a container with
	// little to copy (a fork, whose memory maps files already) is not
	// even frozen.
	type planned struct {
		pid  int
		uffd *os.File
		vmas []rehome.VMA
	}
	var plans []planned
	var held uint64
	for _, pid := range req.Pids {
		vmas, err := rehome.PlanWith(pid, rehome.PlanOptions{MemDir: req.MemDir})
		if err != nil {
			continue
		}
		for _, v := range vmas {
			if !v.Whole && !v.Prepared && v.Replaces == "" {
				held += v.Pages * uint64(os.Getpagesize())
			}
		}
		plans = append(plans, planned{pid: pid, vmas: vmas})
	}
	if min := cmp.Or(req.MinBytes, MinPreCopy); int64(held) < min {
		f.Close()
		reply.PreCopy = time.Since(t0)
		return nil, reply // nothing worth it: the move copies it all
	}
	uffds, frozen, err := userfaultfds(req.Freezer, req.Pids)
	reply.Frozen = frozen
	if err != nil {
		f.Close()
		return fail(err)
	}
	for i := range plans {
		plans[i].uffd = uffds[plans[i].pid]
		delete(uffds, plans[i].pid)
	}
	for _, u := range uffds {
		u.Close() // a process without a plan
	}
	slot := 0
	var errs []error
	for _, p := range plans {
		if p.uffd == nil {
			continue
		}
		for i := range p.vmas {
			p.vmas[i].Slot += slot
		}
		pc, err := rehome.StartPreCopy(p.uffd, p.pid, p.vmas, f)
		if err != nil {
			errs = append(errs, fmt.Errorf("process %d: %w", p.pid, err))
			continue
		}
		pre.pcs = append(pre.pcs, pc)
		slot = rehome.SlotsUsed(pre.pcs)
		reply.PreCopied += pc.Bytes
		reply.PreCopyVMAs += len(pc.VMAs)
		reply.Protect += pc.Protect
	}
	reply.PreCopy = time.Since(t0)
	if len(pre.pcs) == 0 {
		f.Close()
		if err := errors.Join(errs...); err != nil {
			reply.Err = err.Error()
		}
		return nil, reply
	}
	return pre, reply
}

// userfaultfds freezes the container (unless it is frozen), seizes its
// processes, takes a userfaultfd of each (a process that refuses one is left
// out) and lets them go. It returns how long they were frozen.
func userfaultfds(cg string, pids []int) (map[int]*os.File, time.Duration, error) {
	wasFrozen, err := freezer.State(cg)
	if err != nil {
		return nil, 0, err
	}
	t0 := time.Now()
	if !wasFrozen {
		if err := freezer.Set(cg, true); err != nil {
			return nil, 0, err
		}
	}
	uffds := map[int]*os.File{}
	tr, err := rehome.Seize(cg, pids...)
	if err == nil {
		for _, pid := range pids {
			if uffd, uerr := tr.Userfaultfd(pid); uerr == nil {
				uffds[pid] = uffd
			}
		}
		err = tr.Detach()
	}
	if !wasFrozen {
		err = errors.Join(err, freezer.Set(cg, false))
	}
	frozen := time.Since(t0)
	if err != nil || len(uffds) == 0 {
		for _, u := range uffds {
			u.Close()
		}
		return nil, frozen, errors.Join(err, errors.New("no process took a userfaultfd"))
	}
	return uffds, frozen, nil
}

// finish takes the precopy for a move into f, the processes stopped: if it
// was made into f (the same file), each process's written and gone pages
// are read (PreCopy.Finish); otherwise, or if that fails, it is dropped and
// f emptied of it. It returns the precopy to apply, or nil.
func (p *preCopied) finish(f *os.File) (*preCopied, error) {
	if p == nil {
		return nil, nil
	}
	if !sameFile(p.file, f) {
		p.discard(nil)
		return nil, nil
	}
	var errs []error
	for _, pc := range p.pcs {
		if err := pc.Finish(); err != nil {
			errs = append(errs, err)
		}
	}
	if len(errs) > 0 {
		// The copies are of no use: the move copies everything.
		return nil, errors.Join(p.discard(f))
	}
	p.file.Close()
	return p, nil
}

// discard drops the precopy (its userfaultfds closed) and empties f, if
// not nil, of it.
func (p *preCopied) discard(f *os.File) error {
	if p == nil {
		return nil
	}
	defer p.file.Close()
	return rehome.Discard(p.pcs, f)
}

// of is process pid's precopy, or nil.
func (p *preCopied) of(pid int) *rehome.PreCopy {
	if p == nil {
		return nil
	}
	for _, pc := range p.pcs {
		if pc.Pid == pid {
			return pc
		}
	}
	return nil
}

func (p *preCopied) all() []*rehome.PreCopy {
	if p == nil {
		return nil
	}
	return p.pcs
}

func (p *preCopied) slotsUsed() int {
	if p == nil {
		return 0
	}
	return rehome.SlotsUsed(p.pcs)
}

func sameFile(a, b *os.File) bool {
	var sa, sb unix.Stat_t
	return unix.Fstat(int(a.Fd()), &sa) == nil && unix.Fstat(int(b.Fd()), &sb) == nil && sa.Dev == sb.Dev && sa.Ino == sb.Ino
}
