package rehome

import (
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/lazyfork/lazyfork/internal/freezer"
	"github.com/lazyfork/lazyfork/internal/testutil"
	"github.com/lazyfork/lazyfork/memfile/madvguard"
)

func TestInstallFilterGuardsMadvise(t *testing.T) {
	p := startProg(t, 16)
	dir := tmpfs(t)
	heapStart := p.heap[0] &^ (pageSize - 1)
	guarded := madvguard.Range{Start: heapStart, End: heapStart + p.heap[1]}
	prog, err := madvguard.Program([]madvguard.Range{guarded}, madvguard.Refuse)
	if err != nil {
		t.Fatal(err)
	}
	// Before: madvise on the heap works (on a page the test does not verify
	// afterwards, it would read zeros: use the spare region).
	if l := p.cmdLine(fmt.Sprintf("madv %x %x", p.spare[0], pageSize)); l != "madv 0" {
		t.Fatalf("madvise before the guard: %q", l)
	}
	ticks, t1, t2 := p.verify()

	// Move the process and install the guard in the same stop.
	p.idle()
	tr, err := Seize("", p.pid)
	if err != nil {
		t.Fatal(err)
	}
	vmas, err := Plan(p.pid)
	if err == nil {
		var f *os.File
		path := filepath.Join(dir, "mem")
		if f, err = os.Create(path); err == nil {
			defer f.Close()
			if _, err = CopyPages(p.pid, vmas, f); err == nil {
				_, err = tr.Remap(p.pid, path, vmas)
			}
		}
	}
	var before, after [][][]byte
	if err == nil {
		before, err = tr.Filters(p.pid)
	}
	if err == nil {
		err = tr.InstallFilter(p.pid, prog)
	}
	if err == nil {
		// Read back, the guard is recognised: a later move inside it
		// installs none.
		after, err = tr.Filters(p.pid)
	}
	if derr := tr.Detach(); derr != nil {
		t.Errorf("Detach: %v", derr)
	}
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("processes given no_new_privs: %v", tr.NoNewPrivs)
	inside := []madvguard.Range{{Start: guarded.Start + pageSize, End: guarded.End - pageSize}}
	spare := []madvguard.Range{{Start: p.spare[0], End: p.spare[0] + pageSize}}
	if len(after) == 0 || len(after) != len(before) {
		t.Fatalf("threads read before the guard: %d, after: %d", len(before), len(after))
	}
	for i := range after {
		if len(after[i]) != len(before[i])+1 {
			t.Errorf("thread %d: %d filters before the guard, %d after; want one more (TSYNC)", i, len(before[i]), len(after[i]))
		}
	}
	if got := madvguard.Uncovered(before, madvguard.Refuse, inside); len(got) != 1 {
		t.Errorf("before the guard, uncovered: %v; want the heap", got)
	}
	if got := madvguard.Uncovered(after, madvguard.Refuse, inside); len(got) != 0 {
		t.Errorf("the guard read back from every thread leaves %v of its own range uncovered", got)
	}
	if len(madvguard.Uncovered(after, madvguard.Refuse, spare)) != 1 || len(madvguard.Uncovered(after, madvguard.Zero, inside)) != 1 {
		t.Error("the guard read back covers a range, or a mode, it was not given")
	}

	// Inside the guarded range madvise(MADV_DONTNEED) fails with EINVAL and
	// the bytes stay; outside it succeeds.
	if l := p.cmdLine(fmt.Sprintf("madv %x %x", heapStart+16*pageSize, 4*pageSize)); l != fmt.Sprintf("madv %d", syscall.EINVAL) {
		t.Errorf("madvise(MADV_DONTNEED) in the guarded heap: %q, want EINVAL", l)
	}
	if l := p.cmdLine(fmt.Sprintf("madv %x %x", p.spare[0], pageSize)); l != "madv 0" {
		t.Errorf("madvise(MADV_DONTNEED) outside the guard: %q, want success", l)
	}
	waitTicks(t, p, ticks, t1, t2)
	b, _ := os.ReadFile(fmt.Sprintf("/proc/%d/status", p.pid))
	for l := range strings.SplitSeq(string(b), "\n") {
		if strings.HasPrefix(l, "Seccomp") || strings.HasPrefix(l, "NoNewPrivs") {
			t.Log(l)
		}
	}
}

// freezerCgroup creates a cgroup v1 freezer cgroup holding pid.
func freezerCgroup(t *testing.T, pid int) string {
	t.Helper()
	root := "/sys/fs/cgroup/freezer"
	if _, err := os.Stat(filepath.Join(root, "freezer.state")); err != nil {
		if _, err := os.Stat(filepath.Join(root, "tasks")); err != nil {
			if testutil.InCI() {
				t.Fatalf("no cgroup v1 freezer at %s", root)
			}
			t.Skipf("no cgroup v1 freezer at %s", root)
		}
	}
	cg := filepath.Join(root, fmt.Sprintf("lazyfork-rehome-test-%d", os.Getpid()))
	if err := os.Mkdir(cg, 0o755); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		os.WriteFile(filepath.Join(cg, "freezer.state"), []byte("THAWED"), 0)
		os.WriteFile(filepath.Join(root, "cgroup.procs"), []byte(fmt.Sprint(pid)), 0)
		for i := 0; i < 100; i++ {
			if err := os.Remove(cg); err == nil {
				return
			}
			time.Sleep(20 * time.Millisecond) // the killed program leaves
		}
		t.Errorf("cgroup %s stays", cg)
	})
	if err := os.WriteFile(filepath.Join(cg, "cgroup.procs"), []byte(fmt.Sprint(pid)), 0); err != nil {
		t.Fatal(err)
	}
	return cg
}

func TestRemapFrozenCgroup(t *testing.T) {
	p := startProg(t, 64)
	dir := tmpfs(t)
	cg := freezerCgroup(t, p.pid)
	ticks, t1, t2 := p.verify()
	p.idle()
	if err := freezer.Set(cg, true); err != nil {
		t.Fatal(err)
	}
	vmas, done := rehome(t, p, cg, filepath.Join(dir, "mem"))
	if len(done) != len(vmas) {
		t.Fatalf("converted %d of %d VMAs", len(done), len(vmas))
	}
	// Detach left the cgroup frozen, for the dump that follows.
	st, _ := os.ReadFile(filepath.Join(cg, "freezer.state"))
	if strings.TrimSpace(string(st)) != "FROZEN" {
		t.Errorf("after Detach the cgroup is %s, want FROZEN", st)
	}
	time.Sleep(100 * time.Millisecond)
	if err := freezer.Set(cg, false); err != nil {
		t.Fatal(err)
	}
	waitTicks(t, p, ticks, t1, t2)
	if anon := statusKB(t, p.pid, "RssAnon"); anon > 8<<10 {
		t.Errorf("RssAnon after the move: %d kB", anon)
	}
}

func TestRemapStoppedProcess(t *testing.T) {
	p := startProg(t, 16)
	dir := tmpfs(t)
	ticks, t1, t2 := p.verify()
	p.idle()
	if err := syscall.Kill(p.pid, syscall.SIGSTOP); err != nil {
		t.Fatal(err)
	}
	waitState(t, p.pid, "T")
	vmas, done := rehome(t, p, "", filepath.Join(dir, "mem"))
	if len(done) != len(vmas) {
		t.Fatalf("converted %d of %d VMAs", len(done), len(vmas))
	}
	// Stopped before, stopped after.
	waitState(t, p.pid, "T")
	if err := syscall.Kill(p.pid, syscall.SIGCONT); err != nil {
		t.Fatal(err)
	}
	waitTicks(t, p, ticks, t1, t2)
}

func waitState(t *testing.T, pid int, want string) {
	t.Helper()
	for i := 0; ; i++ {
		b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
		if err != nil {
			t.Fatal(err)
		}
		s := string(b)
		f := strings.Fields(s[strings.LastIndexByte(s, ')')+1:])
		if f[0] == want {
			return
		}
		if i == 500 {
			t.Fatalf("process %d is in state %s, want %s", pid, f[0], want)
		}
		time.Sleep(2 * time.Millisecond)
	}
}

// Two processes of one frozen cgroup move in one stop onto one file, each
// VMA in its own slot.
func TestRemapTwoProcessesOneFile(t *testing.T) {
	a := startProg(t, 32)
	b := startProg(t, 16)
	dir := tmpfs(t)
	cg := freezerCgroup(t, a.pid)
	if err := os.WriteFile(filepath.Join(cg, "cgroup.procs"), []byte(fmt.Sprint(b.pid)), 0); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		os.WriteFile("/sys/fs/cgroup/freezer/cgroup.procs", []byte(fmt.Sprint(b.pid)), 0)
	})
	ta, a1, a2 := a.verify()
	tb, b1, b2 := b.verify()
	a.idle()
	b.idle()
	if err := freezer.Set(cg, true); err != nil {
		t.Fatal(err)
	}
	tr, err := Seize(cg, a.pid, b.pid)
	if err != nil {
		t.Fatal(err)
	}
	path := filepath.Join(dir, "mem")
	f, err := os.Create(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	slot := 0
	var n int
	for _, p := range []*prog{a, b} {
		vmas, err := Plan(p.pid)
		if err == nil {
			for i := range vmas {
				vmas[i].Slot += slot
			}
			slot += len(vmas)
			_, err = CopyPages(p.pid, vmas, f)
		}
		if err == nil {
			var done []VMA
			done, err = tr.Remap(p.pid, path, vmas)
			n += len(done)
		}
		if err != nil {
			tr.Detach()
			t.Fatalf("process %d: %v", p.pid, err)
		}
	}
	if err := tr.Detach(); err != nil {
		t.Fatal(err)
	}
	t.Logf("%d VMAs of 2 processes in %d slots of one file", n, slot)
	if err := freezer.Set(cg, false); err != nil {
		t.Fatal(err)
	}
	waitTicks(t, a, ta, a1, a2)
	waitTicks(t, b, tb, b1, b2)
	for _, p := range []*prog{a, b} {
		if hdr, _ := smapsEntry(t, p.pid, p.heap[0]); !strings.HasSuffix(hdr, path) {
			t.Errorf("process %d: heap is not a mapping of %s: %s", p.pid, path, hdr)
		}
	}
}

// A process whose own seccomp filter forbids openat and mmap still moves:
// the injected calls bypass its filters (PTRACE_O_SUSPEND_SECCOMP).
func TestRemapUnderSeccompFilter(t *testing.T) {
	p := startProg(t, 16)
	dir := tmpfs(t)
	deny := func(nr uint32) []unix.SockFilter {
		return []unix.SockFilter{
			{Code: unix.BPF_JMP | unix.BPF_JEQ | unix.BPF_K, Jt: 0, Jf: 1, K: nr},
			{Code: unix.BPF_RET | unix.BPF_K, K: unix.SECCOMP_RET_ERRNO | uint32(unix.EPERM)},
		}
	}
	prog := []unix.SockFilter{{Code: unix.BPF_LD | unix.BPF_W | unix.BPF_ABS, K: 0}} // seccomp_data.nr
	prog = append(prog, deny(unix.SYS_OPENAT)...)
	prog = append(prog, deny(unix.SYS_MMAP)...)
	prog = append(prog, deny(unix.SYS_PWRITE64)...)
	prog = append(prog, unix.SockFilter{Code: unix.BPF_RET | unix.BPF_K, K: unix.SECCOMP_RET_ALLOW})
	tr, err := Seize("", p.pid)
	if err != nil {
		t.Fatal(err)
	}
	err = tr.InstallFilter(p.pid, prog)
	if derr := tr.Detach(); derr != nil {
		t.Fatal(derr)
	}
	if err != nil {
		t.Fatal(err)
	}
	ticks, t1, t2 := p.verify()
	vmas, done := rehome(t, p, "", filepath.Join(dir, "mem"))
	if len(done) != len(vmas) {
		t.Fatalf("converted %d of %d VMAs", len(done), len(vmas))
	}
	waitTicks(t, p, ticks, t1, t2)
}

// Fits agrees with the kernel: guards installed while it says they fit are
// taken, and the first it says does not fit is refused.
func TestFitsMatchesKernel(t *testing.T) {
	p := startProg(t, 1)
	p.idle()
	tr, err := Seize("", p.pid)
	if err != nil {
		t.Fatal(err)
	}
	defer tr.Detach()
	// Large guards (64 ranges, about 1100 eBPF instructions) reach the
	// bound in a few dozen installs; small ones (one range) then fill what
	// is left, and a one-instruction filter (9 counted) the rest, pinning
	// the count. Addresses as a heap's: their low words above 2^31 cost
	// instructions of their own.
	guard := func(n int) []unix.SockFilter {
		var ranges []madvguard.Range
		for i := uint64(0); i < uint64(n); i++ {
			start := 0x7f3a9c000000 + i*0x200000
			ranges = append(ranges, madvguard.Range{Start: start, End: start + pageSize})
		}
		prog, err := madvguard.Program(ranges, madvguard.Refuse)
		if err != nil {
			t.Fatal(err)
		}
		return prog
	}
	installed := 0
	allow := []unix.SockFilter{{Code: unix.BPF_RET | unix.BPF_K, K: unix.SECCOMP_RET_ALLOW}}
	for _, prog := range [][]unix.SockFilter{guard(64), guard(1), allow} {
		for {
			chains, err := tr.Filters(p.pid)
			if err != nil {
				t.Fatal(err)
			}
			fits := madvguard.Fits(chains, prog)
			err = tr.InstallFilter(p.pid, prog)
			if fits != (err == nil) {
				t.Fatalf("after %d guards, one of %d instructions: Fits says %v, the kernel: %v", installed, len(prog), fits, err)
			}
			if !fits {
				t.Logf("%d guards installed when one of %d instructions no longer fit", installed, len(prog))
				break
			}
			if installed++; installed > 5000 {
				t.Fatal("more than 5000 filters fit")
			}
		}
	}
}

// zeroPFN is the kernel's shared zero page, or 0: never the frame of a page
// that was read once and freed (a kernel without a shared zero page for
// reads gives each read fault a fresh frame, which a move would then take
// for the zero page and leave out of the file).
func TestZeroPFN(t *testing.T) {
	testutil.RequiresRoot(t) // frame numbers
	z := zeroPFN()
	m, err := unix.Mmap(-1, 0, pageSize, unix.PROT_READ, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Munmap(m)
	got := readFaultPFN(m)
	t.Logf("zero page frame %#x; a fresh read-only page maps %#x", z, got)
	if z != 0 && got != z {
		t.Errorf("zeroPFN %#x is not what a read-only page maps (%#x): a page of data with that frame would be skipped", z, got)
	}
}
