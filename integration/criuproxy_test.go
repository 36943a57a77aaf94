package integration

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"

	containerd "github.com/containerd/containerd/v2/client"

	lfclient "github.com/lazyfork/lazyfork/client"
	"github.com/lazyfork/lazyfork/integration/harness"
	"github.com/lazyfork/lazyfork/internal/criuproxy"
)

// criuSpy is a directory holding a `criu` that logs each run's arguments and
// then runs the real CRIU: put in the shims' PATH before the real one, it is
// the CRIU the shims and runc run (the shim takes the first criu on PATH
// outside the proxy's directory as the real one).
type criuSpy struct {
	dir, log string
}

func newCriuSpy(t *testing.T) *criuSpy {
	t.Helper()
	real, err := exec.LookPath("criu")
	if err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	s := &criuSpy{dir: dir, log: filepath.Join(dir, "criu.log")}
	script := "#!/bin/sh\necho \"$*\" >>" + s.log + "\nexec " + real + " \"$@\"\n"
	if err := os.WriteFile(filepath.Join(dir, "criu"), []byte(script), 0o755); err != nil {
		t.Fatal(err)
	}
	// The shims keep the spy's version answer in the host's cache directory
	// (/dev/shm/lazyfork-criu, or the one /run/lazyfork-criu.dir records):
	// removed with the spy (runs before the temporary directory goes).
	t.Cleanup(func() {
		name, err := criuproxy.CacheName(filepath.Join(dir, "criu"), criuproxy.VersionSuffix)
		if err != nil {
			return
		}
		dirs := []string{"/dev/shm/lazyfork-criu"}
		if b, err := os.ReadFile("/run/lazyfork-criu.dir"); err == nil {
			dirs = append(dirs, strings.TrimSpace(string(b)))
		}
		for _, d := range dirs {
			os.Remove(filepath.Join(d, name))
		}
	})
	return s
}

// swrkRuns is how many `criu swrk` runs (runc's, go-criu's) the log holds.
func (s *criuSpy) swrkRuns(t *testing.T) int {
	t.Helper()
	n := 0
	for _, l := range strings.Split(spyLog(t, s.log), "\n") {
		if strings.HasPrefix(l, "swrk ") {
			n++
		}
	}
	return n
}

func (s *criuSpy) reset(t *testing.T) {
	t.Helper()
	if err := os.Remove(s.log); err != nil && !os.IsNotExist(err) {
		t.Fatal(err)
	}
}

// creates is how many `tar --create` runs (CRIU's tmpfs dumps) the log holds.
func (s *tarSpy) creates(t *testing.T) int {
	return strings.Count(spyLog(t, s.log), "--create")
}

// TestForkRestoreRunsCRIUOnce: with the CRIU proxy (bin/criu-proxy), runc's
// version check before a restore or a checkpoint is answered by the proxy, so
// a fork's restore runs CRIU once, not twice, and a checkpoint once; and
// neither runs tar (the proxy archives and extracts CRIU's tmpfs contents
// itself when they are directories, symlinks, device nodes, fifos and small
// files: here /dev's nodes and links, the files written into /dev/shm and
// /run, the empty mounts). The forks work and see what the parent wrote into
// /dev/shm and /run. LAZYFORK_CRIU_PROXY=off: CRIU twice, as runc does
// alone, and tar for every tmpfs mount.
func TestForkRestoreRunsCRIUOnce(t *testing.T) {
	for _, c := range []struct {
		name    string
		env     []string
		perCall int // real CRIU runs per restore or checkpoint
		proxy   bool
	}{
		{"proxy", nil, 1, true},
		{"off", []string{"LAZYFORK_CRIU_PROXY=off"}, 2, false},
	} {
		t.Run(c.name, func(t *testing.T) {
			spy := newCriuSpy(t)
			tars := newTarSpy(t)
			// LAZYFORK_CRIU_KDAT=off: the host's /run/criu.kdat is not linked to
			// a cache of the spy (CRIU still loads what it links to).
			e := startLF(t, harness.Options{BinDirs: []string{spy.dir, tars.dir}, Env: append(c.env, "LAZYFORK_CRIU_KDAT=off")})
			for _, name := range []string{"criu", "tar"} {
				if _, err := os.Stat(filepath.Join(e.Bin, "criu-proxy", name)); err != nil {
					t.Fatalf("no proxy %s beside the shim (make build): %v", name, err)
				}
			}
			ctx := e.ctx(t)
			img, err := e.ImportImage(ctx, "busybox")
			if err != nil {
				t.Fatal(err)
			}
			lf := e.lfClient()
			_, parent := e.run(t, ctx, img, "parent", []string{"sleep", "infinity"})
			e.sh(t, ctx, parent, "echo parent >/tmp/who && echo shm-data >/dev/shm/p && echo run-data >/run/p")
			// CRIU dumps each tmpfs superblock once (runc's masked
			// directories share one).
			wantTars := func(task containerd.Task, v tmpfsView) int {
				if c.proxy {
					return 0
				}
				out := e.sh(t, ctx, task, `while read id par dev root mp rest; do
					case "$rest" in *" - tmpfs "*) [ "$root" = / ] && echo "$dev";; esac
				done </proc/self/mountinfo | sort -u | wc -l`)
				n, err := strconv.Atoi(out)
				if err != nil {
					t.Fatalf("tmpfs superblocks: %q", out)
				}
				return n
			}
			pv := e.tmpfsView(t, ctx, parent)
			t.Logf("parent's tmpfs mounts:\n%s", strings.Join(pv.lines, "\n"))
			if len(pv.full) >= len(pv.lines) {
				t.Fatalf("the parent has no empty tmpfs mount:\n%s", strings.Join(pv.lines, "\n"))
			}
			wantParent := wantTars(parent, pv)
			spy.reset(t)
			tars.reset(t)
			snap, err := lf.Checkpoint(ctx, "parent")
			if err != nil {
				t.Fatal(err)
			}
			if got := tars.creates(t); got != wantParent {
				b, _ := os.ReadFile(tars.log)
				t.Errorf("the parent's checkpoint ran tar --create %d times, want %d (%d tmpfs mounts, %d hold something):\n%s",
					got, wantParent, len(pv.lines), len(pv.full), b)
			}
			if got := spy.swrkRuns(t); got != c.perCall {
				b, _ := os.ReadFile(spy.log)
				t.Errorf("the parent's checkpoint ran criu swrk %d times, want %d:\n%s", got, c.perCall, b)
			}
			spy.reset(t)
			ids := []string{"fork-a", "fork-b"}
			forks, err := lf.RestoreForks(ctx, "parent", snap.Snapshot, len(ids), e.logIO(), lfclient.WithIDs(ids...))
			if err != nil {
				t.Fatal(err)
			}
			if got, want := spy.swrkRuns(t), c.perCall*len(forks); got != want {
				b, _ := os.ReadFile(spy.log)
				t.Errorf("restoring %d forks ran criu swrk %d times, want %d:\n%s", len(forks), got, want, b)
			}
			if got := tars.extracts(t); c.proxy && got != 0 {
				b, _ := os.ReadFile(tars.log)
				t.Errorf("restoring %d forks ran tar --extract %d times, want 0:\n%s", len(forks), got, b)
			}
			for i, f := range forks {
				mine := fmt.Sprintf("echo %s >>/tmp/who && cat /tmp/who /dev/shm/p /run/p", ids[i])
				if out := e.sh(t, ctx, f.Task, mine); out != "parent\n"+ids[i]+"\nshm-data\nrun-data" {
					t.Errorf("fork %s reads %q", ids[i], out)
				}
			}
			fv := e.tmpfsView(t, ctx, forks[0].Task)
			wantFork := wantTars(forks[0].Task, fv)
			spy.reset(t)
			tars.reset(t)
			snap2, err := lf.Checkpoint(ctx, "fork-a")
			if err != nil {
				t.Fatal(err)
			}
			if got := spy.swrkRuns(t); got != c.perCall {
				b, _ := os.ReadFile(spy.log)
				t.Errorf("a fork's checkpoint ran criu swrk %d times, want %d:\n%s", got, c.perCall, b)
			}
			if got := tars.creates(t); got != wantFork {
				b, _ := os.ReadFile(tars.log)
				t.Errorf("a fork's checkpoint ran tar --create %d times, want %d (%d tmpfs mounts, %d hold something):\n%s",
					got, wantFork, len(fv.lines), len(fv.full), b)
			}
			for _, s := range []string{snap2.Snapshot, snap.Snapshot} {
				if err := lf.RemoveSnapshot(ctx, s); err != nil {
					t.Error(err)
				}
			}
		})
	}
}
