package movehelper

import (
	"bufio"
	"bytes"
	"encoding/json"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/lazyfork/lazyfork/internal/testutil"
	"github.com/lazyfork/lazyfork/memfile/madvguard"
	"github.com/lazyfork/lazyfork/memfile/rehome"
)

// startTarget starts a process holding 4 MiB of written anonymous memory.
func startTarget(t *testing.T) int {
	t.Helper()
	py := testutil.RequiresBinary(t, "python3")
	cmd := exec.Command(py, "-c", `import mmap, sys, time
m = mmap.mmap(-1, 4 << 20)
m.write(b"x" * (4 << 20))
print("ready", flush=True)
sys.stdin.read()`)
	stdin, err := cmd.StdinPipe()
	if err != nil {
		t.Fatal(err)
	}
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { stdin.Close(); cmd.Process.Kill(); cmd.Wait() })
	if l, err := bufio.NewReader(stdout).ReadString('\n'); err != nil || l != "ready\n" {
		t.Fatalf("target: %q, %v", l, err)
	}
	return cmd.Process.Pid
}

// maps reports whether process pid maps path.
func maps(t *testing.T, pid int, path string) bool {
	t.Helper()
	b, err := os.ReadFile(filepath.Join("/proc", strconv.Itoa(pid), "maps"))
	if err != nil {
		t.Fatal(err)
	}
	return bytes.Contains(b, []byte(path))
}

// A heap that grows between moves needs a new guard each time, and a live
// process cannot drop one: once the kernel's bound on its filters leaves no
// room for the guard its new memory needs, that memory stays anonymous
// (correct, only not shared) instead of moving unguarded.
func TestMoveLeavesUnguardableMemory(t *testing.T) {
	testutil.RequiresRoot(t)
	dir := t.TempDir()
	if err := unix.Mount("lazyfork-movehelper-test", dir, "tmpfs", 0, "size=256m"); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { unix.Unmount(dir, unix.MNT_DETACH) })
	move := func(pid int, name string) Reply {
		t.Helper()
		file := filepath.Join(dir, name)
		if err := os.WriteFile(file, nil, 0o600); err != nil {
			t.Fatal(err)
		}
		var in, out bytes.Buffer
		json.NewEncoder(&in).Encode(Request{Pids: []int{pid}, HostFile: file, Inside: file, MemDir: dir, Guard: true, Mode: int(madvguard.Refuse)})
		if err := Run(&in, &out); err != nil {
			t.Fatal(err)
		}
		var r Reply
		if err := json.Unmarshal(out.Bytes(), &r); err != nil {
			t.Fatal(err)
		}
		return r
	}

	roomy := startTarget(t)
	moved := move(roomy, "roomy")
	if moved.Err != "" || moved.VMAs == 0 || moved.Unguardable != 0 || !maps(t, roomy, filepath.Join(dir, "roomy")) {
		t.Fatalf("a process with room for its guard: %+v", moved)
	}
	if _, planned := moved.WipeOnFork[roomy]; !planned {
		// The shim would read the frozen tree's smaps a second time.
		t.Errorf("the reply has no wipe-on-fork entry for the process it planned: %v", moved.WipeOnFork)
	}

	full := startTarget(t)
	tr, err := rehome.Seize("", full)
	if err != nil {
		t.Fatal(err)
	}
	// Guards of memory the process does not have, until not even the
	// smallest fits.
	for _, n := range []int{64, 1} {
		var ranges []madvguard.Range
		for i := uint64(0); i < uint64(n); i++ {
			start := 0x100000000 + i*0x200000
			ranges = append(ranges, madvguard.Range{Start: start, End: start + 4096})
		}
		prog, err := madvguard.Program(ranges, madvguard.Refuse)
		if err != nil {
			t.Fatal(err)
		}
		for tr.InstallFilter(full, prog) == nil {
		}
	}
	if err := tr.Detach(); err != nil {
		t.Fatal(err)
	}
	r := move(full, "full")
	if r.Err != "" || r.VMAs != 0 || r.Unguardable == 0 || maps(t, full, filepath.Join(dir, "full")) {
		t.Fatalf("a process with no room for a guard: %+v; want no error, nothing moved, its memory counted unguardable", r)
	}
	t.Logf("moved %d VMAs of a process with room; left %d of one without", moved.VMAs, r.Unguardable)
}

// A plan guardable thinned keeps its slots: the next process of the tree
// starts past the highest, or two processes would write one slot.
func TestSlotsUsedPastDroppedVMAs(t *testing.T) {
	plan := []rehome.VMA{{Slot: 0}, {Slot: 1}, {Slot: 2}}
	kept := []rehome.VMA{plan[2]} // slots 0 and 1 dropped
	if n := slotsUsed(kept); n != 3 {
		t.Errorf("slotsUsed(%v) = %d, want 3", kept, n)
	}
	if n := slotsUsed(nil); n != 0 {
		t.Errorf("slotsUsed(nil) = %d, want 0", n)
	}
}

// A consolidation's regions may go ahead of the request (the shim sends them
// to a waiting helper before the freeze): the request's Hop then names them.
func TestReadRequestPreloaded(t *testing.T) {
	regions := []Region{{Pid: 7, VMA: rehome.VMA{Start: 0x1000, End: 0x9000, Prepared: true,
		Pieces: []rehome.Piece{{Start: 0x1000, End: 0x5000, Path: "/m/a"}, {Start: 0x5000, End: 0x9000, Path: "/m/b"}}}}}
	stream := func(msgs ...Request) *json.Decoder {
		var b bytes.Buffer
		for _, m := range msgs {
			if err := json.NewEncoder(&b).Encode(m); err != nil {
				t.Fatal(err)
			}
		}
		return json.NewDecoder(&b)
	}
	preload := Request{Preload: true, Hop: &Hop{Regions: regions}}
	named := Request{Pids: []int{7}, Hop: &Hop{HostFile: "/h", Inside: "/i", Preloaded: true}}

	req, err := readRequest(stream(preload, named), noPreCopy)
	if err != nil {
		t.Fatal(err)
	}
	if req.Preload || len(req.Pids) != 1 || req.Hop == nil || req.Hop.HostFile != "/h" || len(req.Hop.Regions) != 1 ||
		len(req.Hop.Regions[0].VMA.Pieces) != 2 || req.Hop.Regions[0].VMA.Pieces[1].Path != "/m/b" {
		t.Errorf("preload, then a request naming it: %+v", req)
	}
	// A request carrying its own regions (another container's move took
	// the helper) keeps them.
	own := Request{Pids: []int{8}, Hop: &Hop{HostFile: "/h2", Regions: []Region{{Pid: 8}}}}
	if req, err := readRequest(stream(preload, own), noPreCopy); err != nil || len(req.Hop.Regions) != 1 || req.Hop.Regions[0].Pid != 8 {
		t.Errorf("preload, then a request with its own regions: %+v, %v", req, err)
	}
	// No hop at all: the preload is ignored.
	if req, err := readRequest(stream(preload, Request{Pids: []int{9}}), noPreCopy); err != nil || req.Hop != nil || req.Pids[0] != 9 {
		t.Errorf("preload, then a request without a hop: %+v, %v", req, err)
	}
	if _, err := readRequest(stream(named), noPreCopy); err == nil {
		t.Error("a request naming preloaded regions that never came was taken")
	}
	if _, err := readRequest(stream(preload), noPreCopy); err == nil {
		t.Error("a preload with no request after it was taken as a request")
	}
}

func noPreCopy(*Request) error { return errors.New("no precopy expected") }
