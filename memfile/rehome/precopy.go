package rehome

import (
	"cmp"
	"errors"
	"fmt"
	"os"
	"runtime"
	"slices"
	"time"
	"unsafe"

	"github.com/containerd/errdefs"
	"golang.org/x/sys/unix"
)

// userfaultfd's write-protect mode (linux/userfaultfd.h; golang.org/x/sys
// lacks it). With UFFD_FEATURE_WP_ASYNC (Linux 6.7) the kernel resolves a
// write to a protected page itself, clearing the page's uffd-wp bit, and no
// one handles faults: the process runs as before, and PAGEMAP_SCAN reports
// the pages it wrote since (PAGE_IS_WRITTEN).
const (
	uffdAPI            = 0xaa
	uffdioAPI          = 0xc018aa3f // _IOWR(0xaa, 0x3f, struct uffdio_api)
	uffdioRegister     = 0xc020aa00 // _IOWR(0xaa, 0x00, struct uffdio_register)
	uffdioWriteProtect = 0xc018aa06 // _IOWR(0xaa, 0x06, struct uffdio_writeprotect)
	uffdRegisterModeWP = 1 << 1
	uffdWriteProtectWP = 1 << 0
	uffdFeatureWPAsync = 1 << 15
	uffdUserModeOnly   = 1 // userfaultfd(2) flag: allowed without CAP_SYS_PTRACE

	pageIsWritten = 1 << 1
)

type uffdioAPIArg struct{ api, features, ioctls uint64 }

type uffdioRegisterArg struct{ start, len, mode, ioctls uint64 }

type uffdioWriteProtectArg struct{ start, len, mode uint64 }

// PreCopy is a copy of a running process's private anonymous memory into a
// memory file, made before the freeze, so that the move in the pause
// copies only the pages written since (a first move otherwise copies the
// whole heap while the process is frozen: 300 ms a GiB here).
//
// StartPreCopy write-protects the VMAs through a userfaultfd created in the
// process (Tracee.Userfaultfd) in asynchronous mode, and only then copies
// them: a page written after the copy read it, or while it did, has lost
// its protection. At the move, with the process stopped, Finish reads which
// pages lost it and which are gone (MADV_DONTNEED, munmap), and closes the
// userfaultfd, which unregisters every VMA; Apply then gives the planned
// VMAs that are the same mappings as before their precopied slots, with the
// written pages to copy on top (VMA.PreCopied), and punches the gone ones
// out of the file. A VMA that changed meanwhile (moved, grown, split) loses
// its slot's bytes and moves whole. The process's memory is never touched:
// the userfaultfd only marks pages, and nothing waits on it.
type PreCopy struct {
	Pid   int
	VMAs  []VMA // the VMAs copied, each into its slot
	Bytes int64 // bytes written into the file
	// Protect is the time the kernel took to register and write-protect
	// the VMAs (a page-table walk of the whole heap).
	Protect time.Duration
	uffd    *os.File
	// copied holds, per VMA, the runs of pages the copy took (held
	// pages; zeros among them stay holes).
	copied [][][2]uint64
	// written and gone, per VMA, set by a Finish that succeeded: pages
	// the process wrote since it was protected, and pages it no longer
	// holds.
	written, gone [][][2]uint64
}

// StartPreCopy protects vmas of process pid (private anonymous VMAs of its
// plan, in their slots) with uffd, a userfaultfd of that process, and copies
// the pages they hold into f while the process runs. A VMA the kernel does
// not let register is left out. It takes uffd, closed on failure. The copy
// is charged to the caller's memory cgroup.
func StartPreCopy(uffd *os.File, pid int, vmas []VMA, f *os.File) (*PreCopy, error) {
	pc := &PreCopy{Pid: pid, uffd: uffd}
	api := uffdioAPIArg{api: uffdAPI, features: uffdFeatureWPAsync}
	if err := uffdIoctl(uffd, uffdioAPI, unsafe.Pointer(&api)); err != nil {
		uffd.Close()
		if errors.Is(err, unix.EINVAL) {
			err = errors.Join(err, errdefs.ErrNotImplemented)
		}
		return nil, fmt.Errorf("rehome: process %d: userfaultfd with asynchronous write protection (Linux 6.7): %w", pid, err)
	}
	t0 := time.Now()
	for _, v := range vmas {
		if v.Whole || v.Prepared || v.Replaces != "" {
			continue // file mappings: nothing to protect
		}
		reg := uffdioRegisterArg{start: v.Start, len: v.Len(), mode: uffdRegisterModeWP}
		if uffdIoctl(uffd, uffdioRegister, unsafe.Pointer(&reg)) != nil {
			continue
		}
		wp := uffdioWriteProtectArg{start: v.Start, len: v.Len(), mode: uffdWriteProtectWP}
		if uffdIoctl(uffd, uffdioWriteProtect, unsafe.Pointer(&wp)) != nil {
			continue
		}
		pc.VMAs = append(pc.VMAs, v)
	}
	pc.Protect = time.Since(t0)
	if len(pc.VMAs) == 0 {
		uffd.Close()
		return nil, fmt.Errorf("rehome: process %d: no VMA to precopy: %w", pid, errdefs.ErrNotFound)
	}
	n, copied, err := copyHeld(pid, pc.VMAs, f)
	pc.Bytes, pc.copied = n, copied
	if err != nil {
		uffd.Close()
		return nil, err
	}
	return pc, nil
}

// copyHeld is CopyPages that also returns, per VMA, the runs of held pages
// it copied.
func copyHeld(pid int, vmas []VMA, f *os.File) (int64, [][][2]uint64, error) {
	pm, err := os.Open(fmt.Sprintf("/proc/%d/pagemap", pid))
	if err != nil {
		return 0, nil, fmt.Errorf("rehome: process %d: pagemap: %w", pid, errors.Join(err, errdefs.ErrNotFound))
	}
	defer pm.Close()
	mem, err := os.Open(fmt.Sprintf("/proc/%d/mem", pid))
	if err != nil {
		return 0, nil, fmt.Errorf("rehome: process %d: mem: %w", pid, errors.Join(err, errdefs.ErrNotFound))
	}
	defer mem.Close()
	if err := extend(pid, vmas, f); err != nil {
		return 0, nil, err
	}
	var jobs []window
	for _, v := range vmas {
		jobs = append(jobs, windows(v, v.Start, v.End, copyChunk)...)
	}
	cs := newCopiers(pid, pm, mem, f, copyChunk)
	for _, c := range cs {
		c.held = map[int][][2]uint64{}
	}
	n, err := cs.copy(jobs)
	copied := make([][][2]uint64, len(vmas))
	for i, v := range vmas {
		for _, c := range cs {
			copied[i] = append(copied[i], c.held[v.Slot]...)
		}
		slices.SortFunc(copied[i], func(a, b [2]uint64) int { return cmp.Compare(a[0], b[0]) })
	}
	return n, copied, err
}

// Finish reads, with the process stopped, the pages of each precopied VMA
// that it wrote since they were protected and those it no longer holds. The
// VMAs stay registered until Close: unregistering them walks their page
// tables again to unprotect every page (220 ms a GiB here), while a move
// replaces them anyway. So the plan takes them (PlanOptions.WriteProtected:
// Protects). On an error, Discard the copy.
func (pc *PreCopy) Finish() error {
	if pc.written != nil {
		return nil
	}
	pm, err := os.Open(fmt.Sprintf("/proc/%d/pagemap", pc.Pid))
	if err != nil {
		return fmt.Errorf("rehome: process %d: pagemap: %w", pc.Pid, errors.Join(err, errdefs.ErrNotFound))
	}
	defer pm.Close()
	written := make([][][2]uint64, len(pc.VMAs))
	gone := make([][][2]uint64, len(pc.VMAs))
	for i, v := range pc.VMAs {
		// Written: held (present or swapped, a uffd-wp marker counting
		// as swapped) without the protection.
		w, guard, err := scanPages(pm, v.Start, v.End, pageIsWritten, 0, pageIsPresent|pageIsSwapped)
		if err == nil && guard {
			err = guardErr(pc.Pid, v)
		}
		if err != nil {
			return err
		}
		// Gone: neither present nor swapped.
		g, _, err := scanPages(pm, v.Start, v.End, pageIsPresent|pageIsSwapped, pageIsPresent|pageIsSwapped, 0)
		if err != nil {
			return err
		}
		written[i], gone[i] = w, g
	}
	pc.written, pc.gone = written, gone
	return nil
}

// Protects says whether [start, end) is a VMA the precopy registered.
func (pc *PreCopy) Protects(start, end uint64) bool {
	return slices.ContainsFunc(pc.VMAs, func(v VMA) bool { return v.Start == start && v.End == end })
}

// Close closes the userfaultfd, after the move: what it did not replace is
// unprotected and unregistered.
func (pc *PreCopy) Close() error { return pc.uffd.Close() }

// Apply takes vmas, process Pid's plan at the move (after Finish), and
// returns them with their slots in f: a VMA the same mapping as a precopied
// one gets its slot, marked PreCopied with the pages written since; every
// other one the next free slot from *next (which it advances). The file's
// copies of pages the process no longer holds, and the slots of precopied
// VMAs no longer there, are punched out first.
func (pc *PreCopy) Apply(vmas []VMA, f *os.File, next *int) ([]VMA, error) {
	if pc.written == nil {
		return nil, fmt.Errorf("rehome: process %d: precopy not finished: %w", pc.Pid, errdefs.ErrFailedPrecondition)
	}
	used := make([]bool, len(pc.VMAs))
	out := make([]VMA, 0, len(vmas))
	for _, v := range vmas {
		i := slices.IndexFunc(pc.VMAs, func(p VMA) bool { return p.Start == v.Start && p.End == v.End })
		if i < 0 || v.Whole || v.Prepared || v.Replaces != "" {
			v.Slot = *next
			*next++
			out = append(out, v)
			continue
		}
		used[i] = true
		p := pc.VMAs[i]
		for _, r := range intersect(pc.gone[i], pc.copied[i]) {
			if err := punch(f, p.Offset()+int64(r[0]-p.Start), r[1]-r[0]); err != nil {
				return nil, err
			}
		}
		v.Slot, v.PreCopied, v.written, v.scanned = p.Slot, true, pc.written[i], true
		out = append(out, v)
	}
	for i, p := range pc.VMAs {
		if !used[i] {
			if err := punch(f, p.Offset(), uint64(SlotSize)); err != nil {
				return nil, err
			}
		}
	}
	return out, nil
}

// Drop punches the precopy's slots out of f: its process was not moved.
func (pc *PreCopy) Drop(f *os.File) error {
	for _, p := range pc.VMAs {
		if err := punch(f, p.Offset(), uint64(SlotSize)); err != nil {
			return err
		}
	}
	return nil
}

// Discard closes the userfaultfd (unprotecting the process's pages) and
// empties f, all of whose slots may hold precopied bytes.
func Discard(pcs []*PreCopy, f *os.File) error {
	for _, pc := range pcs {
		pc.uffd.Close()
	}
	if f == nil {
		return nil
	}
	if err := f.Truncate(0); err != nil {
		return fmt.Errorf("rehome: memory file %s: drop a precopy: %w", f.Name(), err)
	}
	return nil
}

// SlotsUsed is the number of slots the precopies take in their file.
func SlotsUsed(pcs []*PreCopy) int {
	n := 0
	for _, pc := range pcs {
		for _, v := range pc.VMAs {
			n = max(n, v.Slot+1)
		}
	}
	return n
}

func punch(f *os.File, off int64, n uint64) error {
	if err := unix.Fallocate(int(f.Fd()), unix.FALLOC_FL_PUNCH_HOLE|unix.FALLOC_FL_KEEP_SIZE, off, int64(n)); err != nil {
		return fmt.Errorf("rehome: memory file %s: punch %d bytes at %#x: %w", f.Name(), n, off, err)
	}
	return nil
}

// intersect returns the overlaps of two sorted lists of disjoint runs.
func intersect(a, b [][2]uint64) [][2]uint64 {
	var out [][2]uint64
	for i, j := 0, 0; i < len(a) && j < len(b); {
		s, e := max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
		if s < e {
			out = append(out, [2]uint64{s, e})
		}
		if a[i][1] < b[j][1] {
			i++
		} else {
			j++
		}
	}
	return out
}

func uffdIoctl(f *os.File, req uintptr, arg unsafe.Pointer) error {
	_, _, e := unix.Syscall(unix.SYS_IOCTL, f.Fd(), req, uintptr(arg))
	runtime.KeepAlive(f)
	if e != 0 {
		return e
	}
	return nil
}
