package fidelity_test

import (
	_ "embed"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"

	"github.com/lazyfork/lazyfork/internal/criurun"
	"github.com/lazyfork/lazyfork/internal/workloads"
)

//go:embed testdata/altmaps.c
var altmapsSource []byte

// startAltMaps builds testdata/altmaps.c and starts it with pairs file/anonymous
// mapping pairs (2*pairs mappings that cannot merge).
func (h *harness) startAltMaps(pairs int) *proc {
	h.t.Helper()
	if err := os.MkdirAll(h.bins, 0o755); err != nil {
		h.t.Fatal(err)
	}
	src := filepath.Join(h.bins, "altmaps.c")
	bin := filepath.Join(h.bins, "altmaps")
	if err := os.WriteFile(src, altmapsSource, 0o644); err != nil {
		h.t.Fatal(err)
	}
	if out, err := exec.CommandContext(h.ctx, "gcc", "-O2", "-o", bin, src).CombinedOutput(); err != nil {
		h.t.Fatalf("gcc altmaps.c: %v\n%s", err, out)
	}
	p := &proc{name: "parent", kind: workloads.Kind("altmaps"), out: workloads.Output(filepath.Join(h.dir, "parent.out"))}
	cmd := []string{bin, "-n", strconv.Itoa(pairs), "-t", "100", "-f", filepath.Join(h.dir, "altmaps.data")}
	w, err := criurun.Start(cmd, criurun.StartOptions{Stdout: string(p.out)})
	if err != nil {
		h.t.Fatal(err)
	}
	h.t.Cleanup(func() { w.Kill() })
	p.pid = w.PID
	if err := p.out.WaitTicks(h.ctx, 3); err != nil {
		h.t.Fatalf("altmaps: %v\n%s", err, tail(p.out))
	}
	return p
}

// raiseMaxMapCount makes room for a process with n mappings (vm.max_map_count is
// 65530 by default) and puts the old value back when the test ends.
func raiseMaxMapCount(t *testing.T, n int) {
	const path = "/proc/sys/vm/max_map_count"
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	old, err := strconv.Atoi(strings.TrimSpace(string(b)))
	if err != nil {
		t.Fatal(err)
	}
	if old >= n {
		return
	}
	if err := os.WriteFile(path, []byte(strconv.Itoa(n)), 0o644); err != nil {
		t.Fatalf("raise vm.max_map_count to %d for the test: %v", n, err)
	}
	t.Cleanup(func() { os.WriteFile(path, []byte(strconv.Itoa(old)), 0o644) })
}

// manyMappings dumps a process holding 2*pairs alternating file and anonymous
// mappings, restores two copies, then a copy of a copy; each must come back with
// every mapping and its contents. CRIU keeps an opened file only for consecutive
// mappings of one file, so a rewrite that gave each converted mapping a file
// of its own made the restore open one file per mapping ("Too many open files").
func manyMappings(t *testing.T, pairs int, plain bool) {
	h := newHarness(t, plain)
	raiseMaxMapCount(t, 2*pairs+1000)
	parent := h.startAltMaps(pairs)
	s, before, after := h.snap(parent, "snap1")
	if !plain && s.Rewrite.PagesMoved < uint64(pairs) {
		t.Errorf("rewrite moved %d pages into memory files; the process has %d anonymous pages", s.Rewrite.PagesMoved, pairs)
	}
	cs := h.restore(s, parent.kind, 2, "copy")
	for _, c := range cs {
		h.continues(c, before, after)
	}
	all := append([]*proc{parent}, cs...)
	h.verifyAll(all, zeros(len(all)))
	v := h.mark(cs[0])
	s2, before2, after2 := h.snap(cs[0], "snap2")
	g := h.restore(s2, parent.kind, 1, "grandcopy")[0]
	h.continues(g, before2, after2)
	h.verifyAll([]*proc{g, cs[0], cs[1], parent}, []uint64{v, v, 0, 0})
	for _, p := range []*proc{parent, cs[0], cs[1], g} {
		rs := p.out.Reports("verify")
		if m := rs[len(rs)-1].Uint("maps"); m < uint64(2*pairs) {
			t.Errorf("%s has %d mappings, want at least %d", p.name, m, 2*pairs)
		}
	}
}

func TestManyMappings(t *testing.T) {
	t.Run("10k", func(t *testing.T) { manyMappings(t, 5000, false) })
	t.Run("20k", func(t *testing.T) { manyMappings(t, 10000, false) })
	t.Run("100k", func(t *testing.T) { manyMappings(t, 50000, false) })
}

// The control: plain CRIU restores the same process.
func TestManyMappingsPlainCRIU(t *testing.T) { manyMappings(t, 10000, true) }
