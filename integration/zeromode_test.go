package integration

import (
	"context"
	"fmt"
	"os"
	"regexp"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	containerd "github.com/containerd/containerd/v2/client"
	"github.com/containerd/containerd/v2/pkg/oci"
	specs "github.com/opencontainers/runtime-spec/specs-go"

	"github.com/lazyfork/lazyfork/integration/harness"
)

// purge asks the purger in task to purge its next chunk and returns the
// report's fields.
func purge(t *testing.T, ctx context.Context, e *lfEnv, id string, task containerd.Task) map[string]string {
	t.Helper()
	logPath := e.TaskLogPath(id)
	lines, _ := harness.ReadLines(logPath)
	if err := task.Kill(ctx, syscall.SIGUSR1); err != nil {
		t.Fatalf("%s: signal: %v", id, err)
	}
	wctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	l, err := harness.WaitLine(wctx, logPath, len(lines), func(l string) bool { return strings.HasPrefix(l, "purge ") })
	if err != nil {
		t.Fatalf("%s: no purge report: %v", id, err)
	}
	out := map[string]string{"line": l}
	for _, kv := range strings.Fields(l)[1:] {
		if k, v, ok := strings.Cut(kv, "="); ok {
			out[k] = v
		}
	}
	return out
}

var tracerRe = regexp.MustCompile(`(?m)^TracerPid:\s+([0-9]+)$`)

// tracer returns the TracerPid of pid (0: not traced).
func tracer(t *testing.T, pid uint32) int {
	t.Helper()
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		t.Fatal(err)
	}
	m := tracerRe.FindSubmatch(b)
	if m == nil {
		t.Fatalf("pid %d: no TracerPid in status", pid)
	}
	n, _ := strconv.Atoi(string(m[1]))
	return n
}

// mapsFile returns the path the VMA holding addr maps in pid ("" for anonymous memory).
func mapsFile(t *testing.T, pid uint32, addr uint64) string {
	t.Helper()
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/maps", pid))
	if err != nil {
		t.Fatal(err)
	}
	for _, l := range strings.Split(string(b), "\n") {
		f := strings.Fields(l)
		if len(f) < 5 {
			continue
		}
		lo, hi, _ := strings.Cut(f[0], "-")
		s, _ := strconv.ParseUint(lo, 16, 64)
		en, _ := strconv.ParseUint(hi, 16, 64)
		if s <= addr && addr < en {
			if len(f) >= 6 {
				return f[5]
			}
			return ""
		}
	}
	t.Fatalf("pid %d: no VMA holds %#x", pid, addr)
	return ""
}

// TestZeroModeForks: with lazyfork.io/madvise=zero, a fork's purge of memory it
// shares with its parent through a memory file succeeds, reads zeros and
// leaves the file (the shim's supervisor turns the call into a fresh anonymous
// mapping: the memory is given back). The fork can be forked again (the
// supervisor lets go while the fork is paused and dumped, and attaches again),
// and the fork's fork purges the same way. Under the default guard (refuse) the
// same purge fails with EINVAL and the data stays.
func TestZeroModeForks(t *testing.T) {
	e := startLF(t, harness.Options{})
	ctx := e.ctx(t)
	purger := buildStatic(t, "./internal/workloads/purger")
	img, err := e.ImportImage(ctx, "busybox")
	if err != nil {
		t.Fatal(err)
	}
	lf := e.lfClient()
	start := func(id string, annot map[string]string) uint64 {
		t.Helper()
		e.run(t, ctx, img, id, []string{"/purger"},
			oci.WithMounts([]specs.Mount{{Destination: "/purger", Type: "bind", Source: purger, Options: []string{"rbind", "ro"}}}),
			oci.WithAnnotations(annot))
		wctx, cancel := context.WithTimeout(ctx, 30*time.Second)
		defer cancel()
		l, err := harness.WaitLine(wctx, e.TaskLogPath(id), 0, func(l string) bool { return strings.HasPrefix(l, "ready ") })
		if err != nil {
			t.Fatalf("%s: not ready: %v", id, err)
		}
		f := strings.Fields(l)
		addr, err := strconv.ParseUint(strings.TrimPrefix(f[1], "addr="), 16, 64)
		if err != nil {
			t.Fatalf("%s: bad ready line %q", id, l)
		}
		return addr
	}
	fork := func(id string) (string, containerd.Task) {
		t.Helper()
		fctx, cancel := context.WithTimeout(ctx, 2*time.Minute)
		defer cancel()
		res, err := lf.Fork(fctx, id, 1, e.logIO())
		if err != nil {
			t.Fatalf("fork %s: %v", id, err)
		}
		return res.Forks[0].Container.ID(), res.Forks[0].Task
	}
	const chunk = 4 << 20

	zid := "zm-" + lfRandom(3)
	addr := start(zid, map[string]string{"lazyfork.io/madvise": "zero"})
	child, ctask := fork(zid)
	if tracer(t, ctask.Pid()) == 0 {
		t.Fatalf("fork %s (pid %d) has no madvise supervisor", child, ctask.Pid())
	}
	if f := mapsFile(t, ctask.Pid(), addr); !strings.HasPrefix(f, "/.lazyfork/mem/") {
		t.Fatalf("fork %s: buffer maps %q, want a memory file", child, f)
	}
	if r := purge(t, ctx, e, child, ctask); r["chunk"] != "0" || r["rc"] != "ok" || r["zero"] != "1" || r["intact"] != "1" {
		t.Fatalf("fork %s, zero mode: %s; want chunk=0 rc=ok zero=1 intact=1", child, r["line"])
	}
	if f := mapsFile(t, ctask.Pid(), addr); f != "" {
		t.Errorf("fork %s: purged chunk still maps %q; want fresh anonymous memory", child, f)
	}
	if f := mapsFile(t, ctask.Pid(), addr+chunk); f == "" {
		t.Errorf("fork %s: the chunk after the purged one left its memory file", child)
	}

	// A fork of the supervised fork: the dump does not hang or fail, and
	// both purge their next chunk the same way.
	grand, gtask := fork(child)
	if tracer(t, gtask.Pid()) == 0 {
		t.Errorf("fork of a fork %s has no madvise supervisor", grand)
	}
	if tracer(t, ctask.Pid()) == 0 {
		t.Errorf("fork %s: the supervisor did not attach again after the fork", child)
	}
	for _, p := range []struct {
		id   string
		task containerd.Task
	}{{child, ctask}, {grand, gtask}} {
		if r := purge(t, ctx, e, p.id, p.task); r["chunk"] != "1" || r["rc"] != "ok" || r["zero"] != "1" || r["intact"] != "1" {
			t.Errorf("%s, zero mode: %s; want chunk=1 rc=ok zero=1 intact=1", p.id, r["line"])
		}
	}

	// The control: the default guard refuses the purge in a fork.
	rid := "zm-refuse-" + lfRandom(3)
	start(rid, nil)
	rchild, rtask := fork(rid)
	if tracer(t, rtask.Pid()) != 0 {
		t.Errorf("refuse-mode fork %s is traced", rchild)
	}
	if r := purge(t, ctx, e, rchild, rtask); r["rc"] != "EINVAL" || r["zero"] != "0" || r["intact"] != "1" {
		t.Errorf("fork %s, refuse mode: %s; want rc=EINVAL zero=0 intact=1", rchild, r["line"])
	}
}
