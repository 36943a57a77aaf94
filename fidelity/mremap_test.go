package fidelity_test

import (
	"context"
	_ "embed"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/lazyfork/lazyfork/internal/criurun"
	"github.com/lazyfork/lazyfork/memfile"
	"github.com/lazyfork/lazyfork/memfile/madvguard"
	"golang.org/x/sys/unix"
)

//go:embed testdata/mremap.c
var mremapSource []byte

// In a copy, memory that was anonymous maps a memory file whose offsets run
// on past each part of it. Without the guard's mremap rule, growing a region
// the kernel had merged with its neighbour showed the neighbour's bytes
// after the old end (merged=stale), and memory moved with mremap left the
// guarded addresses, so MADV_DONTNEED there brought back the file's bytes
// (moved=stale). With the guard, refuse mode fails those calls (a program
// falls back, as it must on ENOMEM) and zero mode's supervisor makes the
// memory anonymous first, so they work as on anonymous memory; growing a
// whole region works in both. A copy and a copy of the copy, each checked
// once (the checks change the regions); the original, unguarded, is the
// control.
func TestMremapInCopies(t *testing.T) {
	anon := "merged=zeros moved=zeros lone=ok"
	for _, tc := range []struct {
		name, mode, want string
	}{
		{"plain", "", anon},
		{"refuse", "refuse", "merged=refused moved=refused lone=ok"},
		{"zero", "zero", anon},
	} {
		t.Run(tc.name, func(t *testing.T) {
			h := newHarness(t, tc.mode == "")
			parent := h.startMremap()
			img1 := h.snapMode(parent, "snap1", tc.mode)
			copy1 := h.restoreOne(img1, "copy")
			img2 := h.snapMode(copy1, "snap2", tc.mode)
			copy2 := h.restoreOne(img2, "grandcopy")
			if tc.mode == "zero" {
				for _, c := range []*mremapProc{copy1, copy2} {
					sup, err := madvguard.SpawnSupervisor(c.pid)
					if err != nil {
						t.Fatal(err)
					}
					defer sup.Close()
				}
			}
			for _, p := range []*mremapProc{parent, copy1, copy2} {
				want := tc.want
				if p == parent {
					want = anon
				}
				if got := h.mremapCheck(p); got != want {
					t.Errorf("%s: %s, want %s", p.name, got, want)
				}
			}
		})
	}
}

type mremapProc struct {
	name, out string
	pid       int
}

func (h *harness) startMremap() *mremapProc {
	h.t.Helper()
	if err := os.MkdirAll(h.bins, 0o755); err != nil {
		h.t.Fatal(err)
	}
	src, bin := filepath.Join(h.bins, "mremap.c"), filepath.Join(h.bins, "mremap")
	if err := os.WriteFile(src, mremapSource, 0o644); err != nil {
		h.t.Fatal(err)
	}
	if out, err := exec.CommandContext(h.ctx, "gcc", "-O2", "-o", bin, src).CombinedOutput(); err != nil {
		h.t.Fatalf("gcc mremap.c: %v\n%s", err, out)
	}
	p := &mremapProc{name: "parent", out: filepath.Join(h.dir, "parent.out")}
	w, err := criurun.Start([]string{bin}, criurun.StartOptions{Stdout: p.out})
	if err != nil {
		h.t.Fatal(err)
	}
	h.t.Cleanup(func() { w.Kill() })
	p.pid = w.PID
	h.waitLine(p, "ready", 1)
	return p
}

// snapMode dumps p (left running) and, unless the loop is plain, rewrites
// the dump with the guard in mode, as the shim does.
func (h *harness) snapMode(p *mremapProc, name, mode string) string {
	h.t.Helper()
	dir := filepath.Join(h.dir, name)
	if _, err := criurun.Dump(h.ctx, p.pid, dir, criurun.DumpOptions{}); err != nil {
		h.t.Fatalf("dump %s: %v", p.name, err)
	}
	if mode == "" {
		return dir
	}
	m, err := madvguard.ParseMode(mode)
	if err != nil {
		h.t.Fatal(err)
	}
	l := h.loop
	opts := memfile.RewriteOptions{Family: l.Family, MapDir: l.MapDir, FileRoot: "/",
		Stage: func(ctx context.Context, staging string) error {
			ranges, err := madvguard.DataRanges(staging, l.MapDir, l.MapDir)
			if err != nil {
				return err
			}
			return madvguard.ApplyMode(staging, ranges, m)
		}}
	if _, err := l.Store.Rewrite(h.ctx, dir, opts); err != nil {
		h.t.Fatalf("rewrite %s: %v", dir, err)
	}
	return dir
}

func (h *harness) restoreOne(dir, name string) *mremapProc {
	h.t.Helper()
	out := filepath.Join(h.dir, name+".out")
	copies, _, err := h.loop.Restore(h.ctx, dir, []string{out})
	if err != nil {
		h.t.Fatalf("restore %s: %v", dir, err)
	}
	h.t.Cleanup(func() { h.loop.Kill(copies...) })
	return &mremapProc{name: name, out: out, pid: copies[0].PID}
}

// mremapCheck asks p for its checks and returns their results.
func (h *harness) mremapCheck(p *mremapProc) string {
	h.t.Helper()
	if err := unix.Kill(p.pid, unix.SIGUSR1); err != nil {
		h.t.Fatalf("SIGUSR1 to %s: %v", p.name, err)
	}
	line := h.waitLine(p, "check ", 1)
	return strings.TrimPrefix(line, "check ")
}

// waitLine waits for the n-th line of p's output starting with prefix.
func (h *harness) waitLine(p *mremapProc, prefix string, n int) string {
	h.t.Helper()
	for {
		b, _ := os.ReadFile(p.out)
		k := 0
		for _, l := range strings.Split(string(b), "\n") {
			if strings.HasPrefix(l, prefix) {
				if k++; k == n {
					return l
				}
			}
		}
		select {
		case <-h.ctx.Done():
			h.t.Fatalf("%s: no %q line: %v\n%s", p.name, prefix, h.ctx.Err(), b)
		case <-time.After(20 * time.Millisecond):
		}
	}
}
