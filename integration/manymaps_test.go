package integration

import (
	"context"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	containerd "github.com/containerd/containerd/v2/client"
	"github.com/containerd/containerd/v2/pkg/oci"
	"github.com/opencontainers/runtime-spec/specs-go"

	"github.com/lazyfork/lazyfork/integration/harness"
)

// TestManyMappingsFork: a container holding 25,000 private file mappings
// alternating with 25,000 anonymous ones (fidelity/testdata/altmaps.c) is
// forked, and the fork forked again; each copy has every mapping and its
// contents. Before, CRIU opened one memory file per converted mapping at
// the restore and ran out of file descriptors (the shim's move onto memory
// files makes the parent's own mappings alternate the same way).
func TestManyMappingsFork(t *testing.T) {
	e := startLF(t, harness.Options{})
	ctx := e.ctx(t)
	bin := staticProgram(t, "fidelity/testdata/altmaps.c")
	img, err := e.ImportImage(ctx, "busybox")
	if err != nil {
		t.Fatal(err)
	}
	const pairs = 25000
	id := "mm-" + lfRandom(3)
	_, task := e.run(t, ctx, img, id, []string{"/altmaps", "-n", strconv.Itoa(pairs), "-t", "100", "-f", "/tmp/altmaps.data"},
		oci.WithMounts([]specs.Mount{{Destination: "/altmaps", Type: "bind", Source: bin, Options: []string{"rbind", "ro"}}}))
	parent := &counter{e: e, id: id, task: task}
	parent.waitLine(t, ctx, 0, "tick 3")
	verify := func(c *counter) {
		t.Helper()
		skip := len(c.lines(t))
		if err := c.task.Kill(ctx, syscall.SIGUSR1); err != nil {
			t.Fatalf("%s: %v", c.id, err)
		}
		l := c.waitLine(t, ctx, skip, "verify ")
		if !strings.Contains(l, " ok=1 ") {
			t.Errorf("%s: %s", c.id, l)
		}
		for _, f := range strings.Fields(l) {
			if v, ok := strings.CutPrefix(f, "maps="); ok {
				if n, _ := strconv.Atoi(v); n < 2*pairs {
					t.Errorf("%s has %d mappings, want at least %d", c.id, n, 2*pairs)
				}
			}
		}
	}
	fork := func(c *counter) *counter {
		t.Helper()
		fctx, cancel := context.WithTimeout(ctx, 5*time.Minute)
		defer cancel()
		t0 := time.Now()
		res, err := e.lfClient().Fork(fctx, c.id, 1, e.logIO())
		if err != nil {
			t.Fatalf("fork %s: %v", c.id, err)
		}
		t.Logf("fork of %s: %v", c.id, time.Since(t0).Round(time.Millisecond))
		var f containerd.Task = res.Forks[0].Task
		return &counter{e: e, id: res.Forks[0].Container.ID(), task: f}
	}
	child := fork(parent)
	verify(child)
	grand := fork(child)
	verify(grand)
	verify(parent)
}

// staticProgram compiles the C program at src (relative to the repository)
// into a static binary in a temporary directory, for a busybox container; a
// machine without a static C toolchain skips the test.
func staticProgram(t *testing.T, src string) string {
	t.Helper()
	repo, err := harness.RepoRoot()
	if err != nil {
		t.Fatal(err)
	}
	bin := filepath.Join(t.TempDir(), strings.TrimSuffix(filepath.Base(src), ".c"))
	if out, err := exec.Command("gcc", "-static", "-O2", "-o", bin, filepath.Join(repo, src)).CombinedOutput(); err != nil {
		t.Skipf("gcc -static %s: %v\n%s", filepath.Base(src), err, out)
	}
	return bin
}
