package memfile_test

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/lazyfork/lazyfork/internal/criurun"
	"github.com/lazyfork/lazyfork/internal/procfs"
	"github.com/lazyfork/lazyfork/internal/testutil"
	"github.com/lazyfork/lazyfork/memfile"
)

// env is a test's private world: a tmpfs-backed store, the memtest program,
// and a control directory for its reports.
type env struct {
	t      testing.TB
	tmp    string
	store  *memfile.Store
	family string
	famDir string
	ctl    string
	bin    string
	seq    int
}

func newEnv(t testing.TB) *env {
	t.Helper()
	testutil.RequiresCRIU(t)
	cc := testutil.RequiresBinary(t, "gcc")
	tmp := t.TempDir()
	memRoot := filepath.Join(tmp, "mem")
	if err := memfile.EnsureTmpfs(memRoot, 4<<30); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { unix.Unmount(memRoot, unix.MNT_DETACH) })
	if err := criurun.BecomeSubreaper(); err != nil {
		t.Fatal(err)
	}
	e := &env{t: t, tmp: tmp, family: "fam-" + strconv.Itoa(os.Getpid())}
	var err error
	if e.store, err = memfile.OpenStore(memRoot); err != nil {
		t.Fatal(err)
	}
	if e.famDir, err = e.store.FamilyDir(e.family); err != nil {
		t.Fatal(err)
	}
	e.ctl = filepath.Join(tmp, "ctl")
	os.Mkdir(e.ctl, 0o755)
	e.bin = filepath.Join(tmp, "memtest")
	if out, err := exec.Command(cc, "-O2", "-o", e.bin, "testdata/memtest.c").CombinedOutput(); err != nil {
		t.Fatalf("gcc: %v\n%s", err, out)
	}
	return e
}

func (e *env) next() int { e.seq++; return e.seq }

// start runs memtest as the init of a new PID namespace and waits until every
// process of its tree is ready.
func (e *env) start(heapMiB, children int) int {
	e.t.Helper()
	return e.startChain(heapMiB, children, 1)
}

// startChain is start with a chain of depth processes under each child.
func (e *env) startChain(heapMiB, children, depth int) int {
	e.t.Helper()
	w, err := criurun.Start([]string{e.bin, e.ctl, strconv.Itoa(heapMiB), strconv.Itoa(children), strconv.Itoa(depth)},
		criurun.StartOptions{Stdout: filepath.Join(e.tmp, fmt.Sprintf("out-%d", e.next()))})
	if err != nil {
		e.t.Fatal(err)
	}
	e.t.Cleanup(func() { w.Kill() })
	e.waitFor("workload ready", func() bool {
		pids, _ := procfs.Tree(w.PID)
		if len(pids) != 1+children*depth {
			return false
		}
		for _, p := range pids {
			if _, err := os.Stat(filepath.Join(e.ctl, fmt.Sprintf("ready-%d", p))); err != nil {
				return false
			}
		}
		return true
	})
	return w.PID
}

func (e *env) waitFor(what string, cond func() bool) {
	e.t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			e.t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// ask signals pid and returns its report line, which must start with word.
func (e *env) ask(pid int, sig syscall.Signal, word string) map[string]string {
	e.t.Helper()
	path := filepath.Join(e.ctl, fmt.Sprintf("report-%d", pid))
	os.Remove(path)
	if err := syscall.Kill(pid, sig); err != nil {
		e.t.Fatalf("signal %d: %v", pid, err)
	}
	var line string
	e.waitFor(fmt.Sprintf("%s report of %d", word, pid), func() bool {
		b, err := os.ReadFile(path)
		line = strings.TrimSpace(string(b))
		return err == nil && line != ""
	})
	f := strings.Fields(line)
	if f[0] != word {
		e.t.Fatalf("pid %d: report %q, expected %s", pid, line, word)
	}
	out := map[string]string{"line": line}
	for _, kv := range f[1:] {
		if k, v, ok := strings.Cut(kv, "="); ok {
			out[k] = v
		}
	}
	return out
}

// verifyTree asks every process of a tree to check its memory.
func (e *env) verifyTree(root int) {
	e.t.Helper()
	pids, err := procfs.Tree(root)
	if err != nil {
		e.t.Fatal(err)
	}
	for _, p := range pids {
		if r := e.ask(p, syscall.SIGUSR1, "verify"); r["ok"] != "1" {
			e.t.Fatalf("pid %d (tree of %d): %s", p, root, r["line"])
		}
	}
}

func (e *env) dump(pid int) string {
	e.t.Helper()
	dir := filepath.Join(e.tmp, fmt.Sprintf("img-%d", e.next()))
	if _, err := criurun.Dump(context.Background(), pid, dir, criurun.DumpOptions{}); err != nil {
		e.t.Fatal(err)
	}
	return dir
}

func (e *env) rewrite(dir string) *memfile.Result {
	e.t.Helper()
	return e.rewriteWipe(dir, nil)
}

// rewriteWipe is rewrite with RewriteOptions.WipeOnFork.
func (e *env) rewriteWipe(dir string, wipe memfile.WipeOnFork) *memfile.Result {
	e.t.Helper()
	res, err := e.store.Rewrite(context.Background(), dir, memfile.RewriteOptions{Family: e.family, MapDir: e.famDir, WipeOnFork: wipe})
	if err != nil {
		e.t.Fatal(err)
	}
	mib := float64(res.BytesWritten) / (1 << 20)
	e.t.Logf("rewrite %s: moved %d pages, kept %d, wrote %.1f MiB in %v (%.2f GiB/s), rebased=%v, files %v",
		filepath.Base(dir), res.PagesMoved, res.PagesKept, mib, res.Duration,
		mib/1024/res.Duration.Seconds(), res.Rebased, res.Files)
	return res
}

func (e *env) restore(dir string) int {
	e.t.Helper()
	res, err := criurun.Restore(context.Background(), dir, criurun.RestoreOptions{
		Stdout: filepath.Join(e.tmp, fmt.Sprintf("out-%d", e.next())),
	})
	if err != nil {
		e.t.Fatal(err)
	}
	e.t.Cleanup(func() {
		pids, _ := procfs.Tree(res.PID)
		for i := len(pids) - 1; i >= 0; i-- {
			criurun.Kill(pids[i])
		}
	})
	return res.PID
}

func kill(root int) {
	pids, _ := procfs.Tree(root)
	for i := len(pids) - 1; i >= 0; i-- {
		criurun.Kill(pids[i])
	}
}

func rssAnon(t testing.TB, pid int) int64 {
	t.Helper()
	m, err := procfs.ReadMem(pid)
	if err != nil {
		t.Fatal(err)
	}
	return m.RssAnon
}
