package fidelity_test

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/lazyfork/lazyfork/internal/criurun"
	"github.com/lazyfork/lazyfork/internal/criurun/memloop"
	"github.com/lazyfork/lazyfork/internal/procfs"
	"github.com/lazyfork/lazyfork/internal/testutil"
	"github.com/lazyfork/lazyfork/internal/workloads"
	"github.com/lazyfork/lazyfork/memfile/madvguard"
)

func TestMain(m *testing.M) {
	madvguard.MaybeServe() // zero-mode supervisors are this binary re-executed
	// Detached copies are re-parented to the test binary, which reaps them.
	if os.Geteuid() == 0 {
		if err := criurun.BecomeSubreaper(); err != nil {
			fmt.Fprintln(os.Stderr, "subreaper:", err)
			os.Exit(1)
		}
	}
	// A killed run's copies must not outlive it (rungroup_test.go).
	g := enterRunGroup()
	code := m.Run()
	os.Exit(g.leave(code))
}

// harness is one family in a private tmpfs, plus the processes a test made.
type harness struct {
	t    *testing.T
	ctx  context.Context
	dir  string
	loop *memloop.Loop
	bins string
	// exposed counts verify lines where growing a region merged with its
	// neighbour did not read zeros: the neighbour's bytes without the guard
	// (a documented limit), a refused growth with it.
	exposed int
}

// newHarness gates the test and prepares a family store on a tmpfs of its own; plain
// skips the rewrite (plain CRIU, the control).
func newHarness(t *testing.T, plain bool) *harness {
	return newHarnessGuard(t, plain, false)
}

func newHarnessGuard(t *testing.T, plain, guard bool) *harness {
	testutil.RequiresCRIU(t)
	testutil.RequiresBinary(t, "gcc")
	ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
	t.Cleanup(cancel)
	h := &harness{t: t, ctx: ctx, dir: t.TempDir()}
	h.bins = filepath.Join(h.dir, "bin")
	if plain {
		h.loop = &memloop.Loop{}
		return h
	}
	l, err := memloop.Open(filepath.Join(h.dir, "mem"), "fid-"+strings.ToLower(strings.ReplaceAll(t.Name()[4:], "/", "-")), 8<<30)
	if err != nil {
		t.Fatal(err)
	}
	h.loop = l
	l.Guard = guard
	// Registered first, so it runs after every copy is killed.
	t.Cleanup(func() {
		if err := l.Close(); err != nil {
			t.Error(err)
		}
	})
	return h
}

// proc is a running tree the test talks to: the original workload or a copy.
type proc struct {
	name string
	pid  int
	out  workloads.Output
	kind workloads.Kind
	copy *memloop.Copy // nil for the original workload
}

func (h *harness) start(kind workloads.Kind, heapMiB int) *proc {
	return h.startEnv(kind, heapMiB, workloads.Env(kind))
}

func (h *harness) startEnv(kind workloads.Kind, heapMiB int, env []string) *proc {
	h.t.Helper()
	cmd, err := workloads.Command(h.ctx, kind, h.bins, heapMiB, 100)
	if err != nil {
		h.t.Fatal(err)
	}
	p := &proc{name: "parent", kind: kind, out: workloads.Output(filepath.Join(h.dir, "parent.out"))}
	w, err := criurun.Start(cmd, criurun.StartOptions{Stdout: string(p.out), Env: env})
	if err != nil {
		h.t.Fatal(err)
	}
	h.t.Cleanup(func() { w.Kill() })
	p.pid = w.PID
	if err := p.out.WaitTicks(h.ctx, 5); err != nil {
		h.t.Fatal(err)
	}
	return p
}

// snap dumps p and rewrites the dump; it returns the snapshot and the last tick p
// printed before the dump began and after it ended.
func (h *harness) snap(p *proc, name string) (*memloop.Snapshot, uint64, uint64) {
	h.t.Helper()
	_, before := p.out.Ticks()
	s, err := h.loop.Snapshot(h.ctx, p.pid, filepath.Join(h.dir, name))
	if err != nil {
		h.t.Fatalf("snapshot of %s: %v", p.name, err)
	}
	_, after := p.out.Ticks()
	if s.Rewrite != nil {
		h.t.Logf("%s: dump %v, rewrite %v: %d pages moved, %d kept, rebased=%v, image %d kB",
			name, s.Dump.Duration.Round(time.Millisecond), s.Rewrite.Duration.Round(time.Millisecond),
			s.Rewrite.PagesMoved, s.Rewrite.PagesKept, s.Rewrite.Rebased, s.ImageBytes>>10)
	}
	return s, before, after
}

// restore makes n copies of s at once.
func (h *harness) restore(s *memloop.Snapshot, kind workloads.Kind, n int, prefix string) []*proc {
	h.t.Helper()
	outs := make([]string, n)
	for i := range outs {
		outs[i] = filepath.Join(h.dir, fmt.Sprintf("%s%d.out", prefix, i))
	}
	copies, wall, err := h.loop.Restore(h.ctx, s.Dir, outs)
	if err != nil {
		h.t.Fatalf("restore %d copies of %s: %v", n, s.Dir, err)
	}
	h.t.Cleanup(func() { h.loop.Kill(copies...) })
	h.t.Logf("restored %d copies of %s in %v", n, filepath.Base(s.Dir), wall.Round(time.Millisecond))
	ps := make([]*proc, n)
	for i, c := range copies {
		ps[i] = &proc{name: fmt.Sprintf("%s%d", prefix, i), pid: c.PID, out: workloads.Output(c.Out), kind: kind, copy: c}
	}
	return ps
}

// continues checks that a copy went on from its parent's state: its first tick
// follows a tick its parent printed around the dump, never a fresh start.
func (h *harness) continues(c *proc, before, after uint64) {
	h.t.Helper()
	if err := c.out.WaitTicks(h.ctx, before+2); err != nil {
		h.t.Fatalf("%s: %v\n%s", c.name, err, tail(c.out))
	}
	first, _ := c.out.Ticks()
	if first < before || first > after+1 {
		h.t.Fatalf("%s: first tick %d, parent printed %d before the dump and %d after", c.name, first, before, after)
	}
}

// verifyAll asks every process for a full check at once and wants ok=1 and the
// given marker (the last value the process itself or its ancestor wrote).
func (h *harness) verifyAll(ps []*proc, markers []uint64) {
	h.t.Helper()
	type ask struct{ verify, child int }
	asks := make([]ask, len(ps))
	for i, p := range ps {
		asks[i] = ask{len(p.out.Reports("verify")), len(p.out.Reports("child-verify"))}
		if err := unix.Kill(p.pid, unix.SIGUSR1); err != nil {
			h.t.Fatalf("%s: %v", p.name, err)
		}
	}
	for i, p := range ps {
		rs, err := p.out.WaitReports(h.ctx, "verify", asks[i].verify+1)
		if err != nil {
			h.t.Fatalf("%s: %v\n%s", p.name, err, tail(p.out))
		}
		v := rs[asks[i].verify]
		if v.Fields["mremap"] != "" && v.Fields["mremap"] != "ok" {
			h.t.Errorf("%s: mremap growth of a region did not read zeros: %s", p.name, v.Line)
		}
		if nb := v.Fields["mremap_neighbour"]; nb != "" && nb != "ok" {
			// Known limit (memfile doc, the merged-VMA case): growing part of a VMA the kernel
			// merged before the dump shows the neighbour's bytes. Counted, not failed.
			h.exposed++
		}
		if !v.OK() {
			h.t.Errorf("%s: memory check failed: %s", p.name, v.Line)
		}
		if got := v.Uint("marker"); got != markers[i] {
			h.t.Errorf("%s: marker %d, want %d (a write leaked between copies?): %s", p.name, got, markers[i], v.Line)
		}
		if p.kind == workloads.Python {
			cs, err := p.out.WaitReports(h.ctx, "child-verify", asks[i].child+1)
			if err != nil {
				h.t.Fatalf("%s: the child process did not answer: %v\n%s\nwhere its processes wait:\n%s", p.name, err, tail(p.out), waits(p.pid))
			}
			if c := cs[asks[i].child]; !c.OK() {
				h.t.Errorf("%s: child process check failed: %s", p.name, c.Line)
			}
		}
	}
}

func (h *harness) mark(p *proc) uint64 {
	h.t.Helper()
	v, err := p.out.Mark(h.ctx, p.pid)
	if err != nil {
		h.t.Fatalf("%s: %v", p.name, err)
	}
	return v
}

func (h *harness) mem(p *proc) procfs.Mem {
	h.t.Helper()
	m, err := procfs.TreeMem(p.pid)
	if err != nil {
		h.t.Fatalf("%s: %v", p.name, err)
	}
	return m
}

func tail(o workloads.Output) string {
	ls := o.Lines()
	if len(ls) > 8 {
		ls = ls[len(ls)-8:]
	}
	return "  | " + strings.Join(ls, "\n  | ")
}

func zeros(n int) []uint64 { return make([]uint64, n) }

// waits says where each thread of pid's process tree is: its state, the
// kernel function it sleeps in and its system call (arguments included), and
// its signal masks, and its kernel stack, so that a copy that hangs leaves more
// than a timeout behind. (The python child that once seemed to hang here had
// answered: its line was glued to its parent's, see pyheap's emit.)
func waits(pid int) string {
	pids, err := procfs.Tree(pid)
	if err != nil {
		return err.Error()
	}
	var b strings.Builder
	read := func(path string) string {
		v, err := os.ReadFile(path)
		if err != nil {
			return "?"
		}
		return strings.TrimSpace(string(v))
	}
	for _, p := range pids {
		dir := fmt.Sprintf("/proc/%d/task", p)
		tids, _ := os.ReadDir(dir)
		for _, t := range tids {
			td := filepath.Join(dir, t.Name())
			state := read(td + "/stat")
			if i := strings.LastIndexByte(state, ')'); i >= 0 && i+3 <= len(state) {
				state = state[i+2 : i+3]
			}
			var sigs []string
			for _, l := range strings.Split(read(td+"/status"), "\n") {
				if strings.HasPrefix(l, "Sig") || strings.HasPrefix(l, "ShdPnd") {
					sigs = append(sigs, strings.Join(strings.Fields(l), ""))
				}
			}
			fmt.Fprintf(&b, "pid %d tid %s (%s) %s wchan %s syscall %s\n    signals %s\n", p, t.Name(), read(td+"/comm"),
				state, read(td+"/wchan"), read(td+"/syscall"), strings.Join(sigs, " "))
			for _, l := range strings.Split(read(td+"/stack"), "\n") {
				fmt.Fprintf(&b, "    %s\n", l)
			}
		}
	}
	return b.String()
}
