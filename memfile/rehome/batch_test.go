//go:build linux && amd64

package rehome

import (
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"

	"golang.org/x/sys/unix"
)

// sigtrapDisposition is whether process pid ignores and catches SIGTRAP
// (/proc/pid/status SigIgn, SigCgt).
func sigtrapDisposition(t *testing.T, pid int) (ignored, caught bool) {
	t.Helper()
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		t.Fatal(err)
	}
	bit := uint64(1) << (unix.SIGTRAP - 1)
	for l := range strings.SplitSeq(string(b), "\n") {
		k, v, _ := strings.Cut(l, ":")
		m, _ := strconv.ParseUint(strings.TrimSpace(v), 16, 64)
		switch k {
		case "SigIgn":
			ignored = m&bit != 0
		case "SigCgt":
			caught = m&bit != 0
		}
	}
	return ignored, caught
}

// execMappings lists process pid's anonymous executable mappings.
func execMappings(t *testing.T, pid int) []string {
	t.Helper()
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/maps", pid))
	if err != nil {
		t.Fatal(err)
	}
	var out []string
	for l := range strings.SplitSeq(string(b), "\n") {
		fs := strings.Fields(l)
		if len(fs) == 5 && fs[1][2] == 'x' && fs[4] == "0" {
			out = append(out, l)
		}
	}
	return out
}

// TestPatchMoveBatchesMaps: a move after writes spread over a moved heap
// maps hundreds of patches; they go in batches run by a stub the process
// maps for the move, and the process keeps what it wrote, its SIGTRAP
// handler, and no stub. A process that ignores SIGTRAP (int3's trap would
// reset that) gets one injected call per patch, with the same result.
//
// "kill" sends the process a SIGTRAP while it is seized: a batch takes it
// at its stub (SIGTRAP is the one signal it leaves unblocked), goes on, and
// passes it on after.
func TestPatchMoveBatchesMaps(t *testing.T) {
	for _, mode := range []string{"catch", "ignore", "kill"} {
		t.Run(mode, func(t *testing.T) {
			trap := mode
			if mode == "kill" {
				trap = "catch"
			}
			t.Setenv("HEAPPROG_SIGTRAP", trap)
			p := startProg(t, 64)
			ign0, cgt0 := sigtrapDisposition(t, p.pid)
			if ign0 != (trap == "ignore") || cgt0 != (trap == "catch") {
				t.Fatalf("heapprog's SIGTRAP: ignored %v, caught %v, want %s", ign0, cgt0, trap)
			}
			stubsBefore := execMappings(t, p.pid)
			dir := tmpfs(t)
			rehome(t, p, "", filepath.Join(dir, "a"))
			flips := map[uint64]bool{}
			spread(t, p, flips, 29, 3)

			p.idle()
			tr, err := Seize("", p.pid)
			if err != nil {
				t.Fatal(err)
			}
			vmas, err := PlanWith(p.pid, PlanOptions{MemDir: dir})
			if err != nil {
				tr.Detach()
				t.Fatal(err)
			}
			f, err := os.Create(filepath.Join(dir, "m"))
			if err != nil {
				tr.Detach()
				t.Fatal(err)
			}
			defer f.Close()
			if mode == "kill" {
				p.signalled = true // its handler fails a poll
				// Pending (no thread takes it while all are in ptrace
				// stops) until the first batch's thread unblocks it.
				if err := unix.Kill(p.pid, unix.SIGTRAP); err != nil {
					t.Fatal(err)
				}
			}
			done, st, err := tr.MoveFile(p.pid, f, f.Name(), vmas, 0)
			if derr := tr.Detach(); derr != nil {
				t.Error(derr)
			}
			if err != nil || len(done) != len(vmas) {
				t.Fatalf("patch move: %d of %d VMAs: %v", len(done), len(vmas), err)
			}
			t.Logf("%d VMAs moved, %+v", len(vmas), st)
			if len(vmas) < 400 {
				t.Fatalf("%d VMAs planned: the spread writes should make one patch per page written", len(vmas))
			}
			switch {
			case mode != "ignore" && st.Batched < len(vmas)-1:
				t.Errorf("%d of %d maps ran in batches", st.Batched, len(vmas))
			case trap == "ignore" && st.Batched != 0:
				t.Errorf("%d maps ran in batches in a process that ignores SIGTRAP", st.Batched)
			}
			checkFlips(t, p, flips)
			if mode == "kill" {
				// Its handler runs once for it: passed on, neither lost
				// nor doubled.
				if l := p.cmdLine("traps"); l != "traps 1" {
					t.Errorf("heapprog's handler after one SIGTRAP sent during the move: %q", l)
				}
			}
			if ign, cgt := sigtrapDisposition(t, p.pid); ign != ign0 || cgt != cgt0 {
				t.Errorf("SIGTRAP after the move: ignored %v, caught %v; before: %v, %v", ign, cgt, ign0, cgt0)
			}
			if after := execMappings(t, p.pid); len(after) != len(stubsBefore) {
				t.Errorf("anonymous executable mappings: %q after the move, %q before", after, stubsBefore)
			}
			// Its later writes stay its own, and it runs on.
			spread(t, p, flips, 31, 5)
			checkFlips(t, p, flips)
		})
	}
}
