package integration

import (
	"context"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/containerd/containerd/v2/pkg/oci"
	"github.com/opencontainers/runtime-spec/specs-go"

	"github.com/lazyfork/lazyfork/integration/harness"
	"github.com/lazyfork/lazyfork/integration/workloads"
)

// ask signals c and returns the fields of its next line starting with word.
func (c *counter) ask(t *testing.T, ctx context.Context, sig syscall.Signal, word string) map[string]string {
	t.Helper()
	skip := len(c.lines(t))
	if err := c.task.Kill(ctx, sig); err != nil {
		t.Fatalf("%s: signal %v: %v", c.id, sig, err)
	}
	l := c.waitLine(t, ctx, skip, word+" ")
	kv := map[string]string{"line": l}
	for _, f := range strings.Fields(l)[1:] {
		if k, v, ok := strings.Cut(f, "="); ok {
			kv[k] = v
		}
	}
	return kv
}

// forkN forks c n times in one call.
func (e *lfEnv) forkN(t *testing.T, ctx context.Context, c *counter, n int) []*counter {
	t.Helper()
	fctx, cancel := context.WithTimeout(ctx, 3*time.Minute)
	defer cancel()
	t0 := time.Now()
	res, err := e.lfClient().Fork(fctx, c.id, n, e.logIO())
	if err != nil {
		t.Fatalf("fork %s: %v", c.id, err)
	}
	t.Logf("%d forks of %s: %v (parent paused %v)", n, c.id, time.Since(t0).Round(time.Millisecond), res.Paused.Round(time.Millisecond))
	var out []*counter
	for _, f := range res.Forks {
		out = append(out, &counter{e: e, id: f.Container.ID(), task: f.Task})
	}
	return out
}

// TestNodeFork: a Node.js program holding 100 MB (a Buffer with a per-page
// pattern and 100,000 objects on V8's heap, its collector running) is forked
// twice and a fork forked again; every copy continues with its memory
// intact, and a write in one copy stays in it.
func TestNodeFork(t *testing.T) {
	e := startLF(t, harness.Options{})
	ctx := e.ctx(t)
	repo, err := harness.RepoRoot()
	if err != nil {
		t.Fatal(err)
	}
	img, err := e.ImportImage(ctx, "node")
	if err != nil {
		t.Fatal(err)
	}
	id := "node-" + lfRandom(3)
	_, task := e.run(t, ctx, img, id, []string{"node", "/heap.js", "100"},
		oci.WithMounts([]specs.Mount{{Destination: "/heap.js", Type: "bind", Source: filepath.Join(repo, "integration/workloads/heap.js"), Options: []string{"rbind", "ro"}}}))
	parent := &counter{e: e, id: id, task: task}
	parent.waitLine(t, ctx, 0, "tick 3")
	check := func(c *counter, marker string) {
		t.Helper()
		kv := c.ask(t, ctx, syscall.SIGHUP, "verify")
		if kv["ok"] != "1" || kv["marker"] != marker {
			t.Errorf("%s: %s; want ok=1 marker=%s", c.id, kv["line"], marker)
		}
	}
	forks := e.forkN(t, ctx, parent, 2)
	for _, c := range append([]*counter{parent}, forks...) {
		check(c, "0")
	}
	v := forks[0].ask(t, ctx, syscall.SIGUSR2, "marker")["value"]
	check(forks[0], v)
	check(forks[1], "0")
	check(parent, "0")
	grand := e.forkN(t, ctx, forks[0], 1)[0]
	check(grand, v)
	w := grand.ask(t, ctx, syscall.SIGUSR2, "marker")["value"]
	check(grand, w)
	check(forks[0], v)
}

// TestSQLiteFork: a python process writing a SQLite database in
// transactions (a connection held open, a transaction every 50 ms) is forked
// twice and a fork forked again, with a rollback journal and in WAL mode
// (which holds a file lock all the time and maps its -shm file shared; CRIU
// dumps and restores the locks). Every copy goes on committing with an
// intact database (rows contiguous, checksum, integrity_check) of its own:
// markers written in one copy are in its database only. A copy's
// connection refuses its first write with SQLITE_READONLY_DBMOVED (the copy
// of the file in the fork's rootfs has another inode than the one SQLite
// opened), so the workload reopens it once: a limit of any copy of a
// process onto a copy of its files.
func TestSQLiteFork(t *testing.T) {
	e := startLF(t, harness.Options{})
	ctx := e.ctx(t)
	img, err := e.ImportImage(ctx, "python")
	if err != nil {
		t.Fatal(err)
	}
	for _, journal := range []string{"DELETE", "WAL"} {
		t.Run(journal, func(t *testing.T) {
			id := "sq-" + strings.ToLower(journal) + "-" + lfRandom(3)
			_, task := e.run(t, ctx, img, id, []string{"python3", workloads.ImageDir + "/sqlitewriter.py"},
				oci.WithEnv([]string{"LF_JOURNAL=" + journal}))
			parent := &counter{e: e, id: id, task: task}
			parent.waitLine(t, ctx, 0, "tick 5")
			check := func(c *counter, marks string) {
				t.Helper()
				kv := c.ask(t, ctx, syscall.SIGUSR1, "verify")
				if kv["ok"] != "1" || kv["marks"] != marks {
					t.Errorf("%s: %s; want ok=1 marks=%s", c.id, kv["line"], marks)
				}
			}
			reopens := func(c *counter) int {
				n := 0
				for _, l := range c.lines(t) {
					if strings.HasPrefix(l, "reopen ") {
						n++
					}
				}
				return n
			}
			forks := e.forkN(t, ctx, parent, 2)
			for _, c := range forks {
				c.waitLine(t, ctx, 0, "tick ")
			}
			pm := parent.ask(t, ctx, syscall.SIGUSR2, "marker")["value"]
			fm := forks[0].ask(t, ctx, syscall.SIGUSR2, "marker")["value"]
			check(parent, pm)
			check(forks[0], fm)
			check(forks[1], "-")
			grand := e.forkN(t, ctx, forks[0], 1)[0]
			grand.waitLine(t, ctx, 0, "tick ")
			gm := grand.ask(t, ctx, syscall.SIGUSR2, "marker")["value"]
			check(grand, fm+","+gm)
			check(forks[0], fm)
			check(parent, pm)
			if n := reopens(parent); n != 0 {
				t.Errorf("the parent reopened its database %d times", n)
			}
			for _, c := range append(forks, grand) {
				t.Logf("%s reopened its database %d time(s)", c.id, reopens(c))
			}
		})
	}
}
