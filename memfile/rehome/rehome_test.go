package rehome

import (
	"encoding/binary"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// waitTicks waits until the program's counters move past the given ones:
// its blocking calls and threads still run.
func waitTicks(t *testing.T, p *prog, ticks, t1, t2 uint64) {
	t.Helper()
	for i := 0; ; i++ {
		time.Sleep(50 * time.Millisecond)
		n, a, b := p.verify()
		if n > ticks+1 && a > t1 && b > t2 {
			return
		}
		if i == 100 {
			t.Fatalf("heapprog %d stopped ticking: ticks %d->%d t1 %d->%d t2 %d->%d", p.pid, ticks, n, t1, a, t2, b)
		}
	}
}

func TestRemapRunsOnMemoryFile(t *testing.T) {
	t.Run("copied-by-process", func(t *testing.T) { testRemapRunsOnMemoryFile(t, false) })
	t.Run("copied-by-tracer", func(t *testing.T) { testRemapRunsOnMemoryFile(t, true) })
}

func testRemapRunsOnMemoryFile(t *testing.T, byTracer bool) {
	p := startProg(t, 64)
	dir := tmpfs(t)
	path := filepath.Join(dir, "mem")
	ticks, t1, t2 := p.verify()
	anonBefore := statusKB(t, p.pid, "RssAnon")

	vmas, done := rehome(t, p, "", path, byTracer)
	if len(done) != len(vmas) {
		t.Fatalf("converted %d of %d VMAs", len(done), len(vmas))
	}
	heapV := vmaAt(t, vmas, p.heap[0])
	vmaAt(t, vmas, p.brk[0])

	// The program continues: memory verifies, blocking calls and threads tick.
	waitTicks(t, p, ticks, t1, t2)

	// The heap is a mapping of the file, with no anonymous memory.
	hdr, fl := smapsEntry(t, p.pid, p.heap[0])
	if !strings.HasSuffix(hdr, path) {
		t.Errorf("heap VMA is not a mapping of %s: %s", path, hdr)
	}
	if fl["Anonymous"] > 64 {
		t.Errorf("heap VMA still holds %d kB anonymous memory", fl["Anonymous"])
	}
	anonAfter := statusKB(t, p.pid, "RssAnon")
	t.Logf("RssAnon %d kB -> %d kB; %d VMAs converted", anonBefore, anonAfter, len(done))
	if anonBefore < anonAfter || anonBefore-anonAfter < 60<<10 {
		t.Errorf("RssAnon fell by %d kB, want about the 64 MiB heap", int64(anonBefore)-int64(anonAfter))
	}
	// The heap is held once on the tmpfs.
	used := tmpfsUsed(t, dir)
	t.Logf("tmpfs holds %d kB", used>>10)
	if used < 64<<20 || used > 80<<20 {
		t.Errorf("tmpfs holds %d bytes, want about 64 MiB", used)
	}

	// A second process (this one) mapping the file privately reads the same
	// bytes, from the same page cache: the program's Pss of the heap halves.
	off := heapV.Offset() + int64(p.heap[0]-heapV.Start)
	pageOff := off &^ (pageSize - 1)
	f, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	m, err := unix.Mmap(int(f.Fd()), pageOff, int(p.heap[1])+pageSize, unix.PROT_READ, unix.MAP_PRIVATE)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Munmap(m)
	heap := m[off-pageOff:]
	for i := uint64(0); i < p.heap[1]/8; i++ {
		if got := binary.LittleEndian.Uint64(heap[i*8:]); got != pat(i/512, i%512) {
			t.Fatalf("second mapping: heap word %d = %#x, want %#x", i, got, pat(i/512, i%512))
		}
	}
	_, fl = smapsEntry(t, p.pid, p.heap[0])
	t.Logf("heap VMA after a second mapping: Rss %d kB Pss %d kB Shared_Clean %d kB", fl["Rss"], fl["Pss"], fl["Shared_Clean"])
	if fl["Pss"] > fl["Rss"]*3/4 {
		t.Errorf("heap pages are not shared with a second mapping: Rss %d kB, Pss %d kB", fl["Rss"], fl["Pss"])
	}

	// A write after the move stays private: the file keeps the old bytes.
	if l := p.cmdLine("mark"); l != "marked" {
		t.Fatalf("mark: %q", l)
	}
	p.verify()
	var b [8]byte
	if _, err := f.ReadAt(b[:], off); err != nil {
		t.Fatal(err)
	}
	if got := binary.LittleEndian.Uint64(b[:]); got != pat(0, 0) {
		t.Errorf("file changed under a private write: %#x", got)
	}
}

func TestRemapFailureLeavesProcess(t *testing.T) {
	p := startProg(t, 16)
	dir := tmpfs(t)
	path := filepath.Join(dir, "mem")
	ticks, t1, t2 := p.verify()

	tr, vmas := seizePlanned(t, p)
	f, err := os.Create(path)
	if err != nil {
		tr.Detach()
		t.Fatal(err)
	}
	defer f.Close()
	if _, err := CopyPages(p.pid, vmas, f); err != nil {
		tr.Detach()
		t.Fatal(err)
	}
	// The file does not exist: nothing changes.
	if done, err := tr.Remap(p.pid, path+".missing", vmas); err == nil || len(done) != 0 {
		t.Errorf("Remap of a missing file: converted %d, err %v", len(done), err)
	} else {
		t.Logf("missing file: %v", err)
	}
	// The first VMA (the one holding the path) gets an offset mmap
	// refuses: it stays anonymous with its bytes, the others move.
	bad := append([]VMA(nil), vmas...)
	bad[0].Slot = -1
	done, err := tr.Remap(p.pid, path, bad)
	if err == nil || len(done) != len(vmas)-1 {
		t.Errorf("Remap with a bad offset: converted %d of %d, err %v", len(done), len(vmas), err)
	} else {
		t.Logf("bad offset: %v", err)
	}
	if err := tr.Detach(); err != nil {
		t.Fatalf("Detach: %v", err)
	}
	waitTicks(t, p, ticks, t1, t2)
	hdr, fl := smapsEntry(t, p.pid, vmas[0].Start)
	if strings.Contains(hdr, path) || fl["Anonymous"] == 0 {
		t.Errorf("the VMA whose mmap failed changed: %s (Anonymous %d kB)", hdr, fl["Anonymous"])
	}
}

// With TracerCopies the tracer copies every page (in parallel windows, no
// injected pwrite) and the process only maps: it goes on counting on the
// file, with its heap intact, each VMA one mapping of its slot.
func TestMoveByTracer(t *testing.T) {
	dir := tmpfs(t)
	p := startProg(t, 64)
	ticks, t1, t2 := p.verify()
	path := filepath.Join(dir, "mem")
	if err := os.WriteFile(path, nil, 0o644); err != nil {
		t.Fatal(err)
	}
	tr, vmas := seizePlanned(t, p)
	tr.TracerCopies = true
	done, st, err := tr.Move(p.pid, path, vmas, 8<<20)
	if derr := tr.Detach(); derr != nil {
		t.Error(derr)
	}
	if err != nil || len(done) != len(vmas) {
		t.Fatalf("Move: %d of %d VMAs: %v", len(done), len(vmas), err)
	}
	t.Logf("%+v", st)
	if st.Calls != 0 || st.ByTracer != st.Bytes || st.Bytes < 60<<20 {
		t.Errorf("copy stats %+v: want the tracer to copy the whole 64 MiB heap, the process nothing", st)
	}
	waitTicks(t, p, ticks, t1, t2)
	p.verify()
	hv := vmaAt(t, vmas, p.heap[0])
	hdr, _ := smapsEntry(t, p.pid, p.heap[0])
	if want := fmt.Sprintf("%x-%x ", hv.Start, hv.End); !strings.HasPrefix(hdr, want) || !strings.HasSuffix(hdr, path) {
		t.Errorf("heap is not one mapping of %s over %s: %s", path, want, hdr)
	}
}
