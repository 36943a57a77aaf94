package rehome

import (
	"bytes"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// A precopy made while the process runs, then the move: the process keeps
// its memory exactly (its writes since the precopy, and a purge of pages
// the precopy had copied), the move copies only what was written since,
// and the process is left with no userfaultfd and no registered VMA.
func TestPreCopyThenMove(t *testing.T) {
	p := startProg(t, 64)
	// On one CPU: the kernel writes a thread's rseq area (its CPU number)
	// whenever it returns to user space on another CPU, as the injecting
	// thread does during the move; the byte-exact check below would see it.
	pinTasks(t, p.pid, 0)
	path := filepath.Join(tmpfs(t), "mem")
	f, err := os.Create(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()

	p.idle()
	tr, err := Seize("", p.pid)
	if err != nil {
		t.Fatal(err)
	}
	uffd, err := tr.Userfaultfd(p.pid)
	if derr := tr.Detach(); err != nil || derr != nil {
		t.Fatalf("userfaultfd: %v; detach: %v", err, derr)
	}
	vmas, err := Plan(p.pid)
	if err != nil {
		t.Fatal(err)
	}
	pc, err := StartPreCopy(uffd, p.pid, vmas, f)
	if err != nil {
		t.Fatal(err)
	}
	if heap := vmaAt(t, pc.VMAs, p.heap[0]); heap.Len() < p.heap[1] {
		t.Fatalf("the heap was not precopied whole: %v", pc.VMAs)
	}
	if pc.Bytes < int64(p.heap[1]) {
		t.Fatalf("precopied %d bytes of a %d-byte heap", pc.Bytes, p.heap[1])
	}
	if fds := userfaultfds(t, p.pid); fds != 0 {
		t.Fatalf("the process holds %d userfaultfds of its own", fds)
	}

	// Running on: writes to pages the precopy copied, and a purge.
	if l := p.cmdLine("spread 97 5"); !strings.HasPrefix(l, "spread ") {
		t.Fatal(l)
	}
	const purged = 64 << 10
	if l := p.cmdLine(fmt.Sprintf("madv %x %x", p.spare[0], purged)); l != "madv 0" {
		t.Fatal(l)
	}

	p.idle()
	tr, err = Seize("", p.pid)
	if err != nil {
		t.Fatal(err)
	}
	if err := pc.Finish(); err != nil {
		tr.Detach()
		t.Fatal(err)
	}
	planned, err := PlanWith(p.pid, PlanOptions{WriteProtected: pc.Protects})
	if err != nil {
		tr.Detach()
		t.Fatal(err)
	}
	before := readVMAs(t, p.pid, planned)
	precopied := len(pc.VMAs)
	next := SlotsUsed([]*PreCopy{pc})
	planned, err = pc.Apply(planned, f, &next)
	if err != nil {
		tr.Detach()
		t.Fatal(err)
	}
	if h := vmaAt(t, planned, p.heap[0]); !h.PreCopied {
		tr.Detach()
		t.Fatalf("the heap's VMA is not taken from the precopy: %+v", h)
	}
	tr.TracerCopies = true
	done, st, err := tr.MoveFile(p.pid, f, path, planned, 0)
	// Stopped still: every byte as before the move.
	after := readVMAs(t, p.pid, planned)
	pc.Close()
	if derr := tr.Detach(); err != nil || derr != nil {
		t.Fatalf("move: %v; detach: %v", err, derr)
	}
	t.Logf("precopied %d bytes in %d VMAs; the move wrote %d bytes, %d VMAs", pc.Bytes, precopied, st.Bytes, len(done))
	for i, v := range planned {
		if !bytes.Equal(before[i], after[i]) {
			i0 := 0
			for i0 < len(before[i]) && before[i][i0] == after[i][i0] {
				i0++
			}
			a := v.Start + uint64(i0)
			fb := make([]byte, 8)
			f.ReadAt(fb, v.Offset()+int64(i0))
			written := slices.ContainsFunc(v.written, func(r [2]uint64) bool { return r[0] <= a && a < r[1] })
			t.Errorf("%v (precopied: %v): its bytes changed in the move, first at page %d (%#x): %x -> %x (the file: %x; written since the precopy: %v)", v, v.PreCopied, i0/4096, a, before[i][i0:i0+8], after[i][i0:i0+8], fb, written)
		}
	}
	// 64 MiB / 97 pages written one page each, and the small stuff the
	// process dirties idling: far below the heap.
	if st.Bytes > 4<<20 {
		t.Errorf("the move wrote %d bytes after a precopy of %d: more than what was written since", st.Bytes, pc.Bytes)
	}
	p.verify()
	if hdr, _ := smapsEntry(t, p.pid, p.heap[0]); !strings.Contains(hdr, path) {
		t.Errorf("the heap does not map the memory file: %s", hdr)
	}
	mem, err := os.Open(fmt.Sprintf("/proc/%d/mem", p.pid))
	if err != nil {
		t.Fatal(err)
	}
	defer mem.Close()
	spare := make([]byte, p.spare[1])
	if _, err := mem.ReadAt(spare, int64(p.spare[0])); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(spare[:purged], make([]byte, purged)) || !bytes.Equal(spare[purged:], bytes.Repeat([]byte{1}, len(spare)-purged)) {
		t.Errorf("the purged pages do not read zeros, or the others lost their bytes")
	}
	if fds := userfaultfds(t, p.pid); fds != 0 {
		t.Errorf("the process holds %d userfaultfds", fds)
	}
	if b, err := os.ReadFile(fmt.Sprintf("/proc/%d/smaps", p.pid)); err != nil {
		t.Fatal(err)
	} else if strings.Contains(string(b), " uw") {
		t.Errorf("a VMA is still registered for write protection")
	}
}

// pinTasks pins every thread of process pid to one CPU.
func pinTasks(t *testing.T, pid, cpu int) {
	t.Helper()
	tids, err := listTasks(pid)
	if err != nil {
		t.Fatal(err)
	}
	var set unix.CPUSet
	set.Set(cpu)
	for _, tid := range tids {
		if err := unix.SchedSetaffinity(tid, &set); err != nil {
			t.Fatal(err)
		}
	}
	time.Sleep(50 * time.Millisecond) // each runs once there: its rseq area says so
}

// readVMAs reads the bytes of each VMA through /proc/pid/mem.
func readVMAs(t *testing.T, pid int, vmas []VMA) [][]byte {
	t.Helper()
	mem, err := os.Open(fmt.Sprintf("/proc/%d/mem", pid))
	if err != nil {
		t.Fatal(err)
	}
	defer mem.Close()
	out := make([][]byte, len(vmas))
	for i, v := range vmas {
		out[i] = make([]byte, v.Len())
		if _, err := mem.ReadAt(out[i], int64(v.Start)); err != nil {
			t.Fatalf("read %v: %v", v, err)
		}
	}
	return out
}

// userfaultfds counts the userfaultfds among the process's descriptors.
func userfaultfds(t *testing.T, pid int) int {
	t.Helper()
	ents, err := os.ReadDir(fmt.Sprintf("/proc/%d/fd", pid))
	if err != nil {
		t.Fatal(err)
	}
	n := 0
	for _, e := range ents {
		if l, _ := os.Readlink(fmt.Sprintf("/proc/%d/fd/%s", pid, e.Name())); strings.Contains(l, "userfaultfd") {
			n++
		}
	}
	return n
}
