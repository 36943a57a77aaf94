package memfile_test

import (
	"reflect"
	"strconv"
	"syscall"
	"testing"

	"github.com/lazyfork/lazyfork/internal/procfs"
	"github.com/lazyfork/lazyfork/memfile"
	"github.com/lazyfork/lazyfork/memfile/rehome"
)

// TestWipeOnFork: memory a process marked MADV_WIPEONFORK (where Go and new
// glibc keep their vDSO getrandom state) must start zeroed in every copy, as
// in a fork() child, and keep the advice; CRIU alone copies its bytes.
func TestWipeOnFork(t *testing.T) {
	e := newEnv(t)
	orig := e.start(4, 1)
	pids, err := procfs.Tree(orig)
	if err != nil {
		t.Fatal(err)
	}
	wipe, err := memfile.ReadWipeOnFork(orig)
	if err != nil {
		t.Fatal(err)
	}
	addr := map[int]uint64{}
	for _, p := range pids {
		r := e.ask(p, syscall.SIGUSR1, "verify")
		if r["wipe"] == "0" {
			t.Fatalf("pid %d: its wipe-on-fork page reads 0 before any dump: %s", p, r["line"])
		}
		addr[p], _ = strconv.ParseUint(r["wipe_addr"], 16, 64)
	}
	if len(wipe) != len(pids) {
		t.Fatalf("ReadWipeOnFork found ranges in %d processes of %d: %v", len(wipe), len(pids), wipe)
	}
	for _, rs := range wipe {
		found := false
		for _, r := range rs {
			found = found || (r.Start == addr[orig] && r.End == addr[orig]+2*4096)
		}
		if !found {
			t.Errorf("ReadWipeOnFork: no range at %#x (2 pages) in %v", addr[orig], rs)
		}
	}

	// The control: a rewrite that is not told copies the bytes.
	plainDir := e.dump(orig)
	e.rewrite(plainDir)
	plain := e.restore(plainDir)
	if r := e.ask(plain, syscall.SIGUSR1, "verify"); r["wipe"] == "0" {
		t.Errorf("control: a copy without WipeOnFork read 0 (%s): the test no longer shows the problem", r["line"])
	}

	dir := e.dump(orig)
	res := e.rewriteWipe(dir, wipe)
	if res.PagesWiped != uint64(len(pids)) {
		t.Errorf("PagesWiped %d, expected one page per process (%d)", res.PagesWiped, len(pids))
	}
	for i := 0; i < 2; i++ {
		c := e.restore(dir)
		cpids, err := procfs.Tree(c)
		if err != nil {
			t.Fatal(err)
		}
		for _, p := range cpids {
			r := e.ask(p, syscall.SIGUSR1, "verify")
			if r["ok"] != "1" || r["wipe"] != "0" {
				t.Errorf("copy %d pid %d: %s; expected ok=1 and a zeroed wipe-on-fork page", i, p, r["line"])
			}
		}
		// The advice is back, so a copy of this copy is wiped too.
		again, err := memfile.ReadWipeOnFork(c)
		if err != nil {
			t.Fatal(err)
		}
		if len(again) != len(cpids) {
			t.Errorf("copy %d: MADV_WIPEONFORK not restored: %v", i, again)
		}
	}
	// The parent keeps its own.
	if r := e.ask(orig, syscall.SIGUSR1, "verify"); r["wipe"] == "0" {
		t.Errorf("parent: its wipe-on-fork page reads 0 after the dumps: %s", r["line"])
	}
}

// TestWipeOnForkOfPlan: the ranges a move's plan reports (rehome.PlanWith's
// WipeOnFork, by host pid) are what ReadWipeOnFork finds, so that a move's
// dump need not read the tree's smaps again; a tree the plan did not cover
// entirely is refused (the caller reads it).
func TestWipeOnForkOfPlan(t *testing.T) {
	e := newEnv(t)
	orig := e.start(4, 1)
	pids, err := procfs.Tree(orig)
	if err != nil {
		t.Fatal(err)
	}
	want, err := memfile.ReadWipeOnFork(orig)
	if err != nil {
		t.Fatal(err)
	}
	if len(want) != len(pids) {
		t.Fatalf("ReadWipeOnFork found ranges in %d processes of %d: the test program no longer marks any", len(want), len(pids))
	}
	byPid := map[int][][2]uint64{}
	for _, p := range pids {
		byPid[p] = nil // planned, even if it marked nothing
		if _, err := rehome.PlanWith(p, rehome.PlanOptions{WipeOnFork: func(start, end uint64) {
			byPid[p] = append(byPid[p], [2]uint64{start, end})
		}}); err != nil {
			t.Fatal(err)
		}
	}
	got, ok := memfile.WipeOnForkOf(orig, byPid)
	if !ok {
		t.Fatalf("WipeOnForkOf refused a tree planned entirely")
	}
	if !reflect.DeepEqual(got, want) {
		t.Errorf("from the plan: %v; ReadWipeOnFork: %v", got, want)
	}
	delete(byPid, pids[len(pids)-1])
	if w, ok := memfile.WipeOnForkOf(orig, byPid); ok {
		t.Errorf("WipeOnForkOf accepted a tree with process %d not planned: %v", pids[len(pids)-1], w)
	}
}
