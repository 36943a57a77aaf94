package integration

import (
	"bufio"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"

	containerd "github.com/containerd/containerd/v2/client"
	"github.com/containerd/containerd/v2/pkg/cio"
	specs "github.com/opencontainers/runtime-spec/specs-go"

	"github.com/lazyfork/lazyfork/integration/harness"
	"github.com/lazyfork/lazyfork/memfile"
)

// statusKB reads a "Name: N kB" field of /proc/PID/status.
func statusKB(t *testing.T, pid uint32, field string) int64 {
	t.Helper()
	f, err := os.Open(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		if v, ok := strings.CutPrefix(sc.Text(), field+":"); ok {
			n, _ := strconv.ParseInt(strings.TrimSuffix(strings.TrimSpace(v), " kB"), 10, 64)
			return n
		}
	}
	t.Fatalf("no %s in /proc/%d/status", field, pid)
	return 0
}

// tmpfsBytes is what the LazyFork root's memory store holds on disk.
func tmpfsBytes(t *testing.T, root string) int64 {
	t.Helper()
	var n int64
	filepath.Walk(filepath.Join(root, "mem"), func(p string, fi os.FileInfo, err error) error {
		if err == nil && fi.Mode().IsRegular() && !strings.Contains(p, "/.views/") {
			n += fi.Sys().(*syscall.Stat_t).Blocks * 512
		}
		return nil
	})
	return n
}

// TestRehome: a running container forked the first time moves onto its
// snapshot's memory file (issue 11). It keeps its task, pid, exec sessions
// and count; its anonymous memory falls to a few MB; its writes and its
// fork's stay apart; and its next snapshots are deltas: no new memory file,
// a small image.
func TestRehome(t *testing.T) {
	e, ctx, img := startLFPython(t)
	lf := e.lfClient()
	parent := e.startCounter(t, ctx, img, "home-"+lfRandom(3), 64)
	pid := parent.task.Pid()

	// An exec session started before the move must live through it.
	execLog := filepath.Join(e.Dir, "logs", "exec-"+parent.id+".log")
	proc, err := parent.task.Exec(ctx, "ticker", &specs.Process{
		Args: []string{"sh", "-c", "while sleep 0.05; do echo x; done"}, Cwd: "/",
		Env: []string{"PATH=/usr/bin:/bin"},
	}, cio.LogFile(execLog))
	if err != nil {
		t.Fatal(err)
	}
	execExit, err := proc.Wait(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if err := proc.Start(ctx); err != nil {
		t.Fatal(err)
	}

	anonBefore := statusKB(t, pid, "RssAnon")
	bytesBefore := tmpfsBytes(t, e.Root)
	res, err := lf.Fork(ctx, parent.id, 1, e.logIO())
	if err != nil {
		t.Fatal(err)
	}
	fork := e.forks(res)[0]
	checkContinues(t, ctx, parent, fork)
	anonAfter := statusKB(t, pid, "RssAnon")
	t.Logf("first fork: paused %v; parent RssAnon %d kB -> %d kB; tmpfs +%d kB",
		res.Paused, anonBefore, anonAfter, (tmpfsBytes(t, e.Root)-bytesBefore)>>10)
	if anonAfter > 8<<10 || anonAfter > anonBefore/4 {
		t.Errorf("parent's anonymous memory %d kB after its first fork (was %d kB): it did not move onto the memory file", anonAfter, anonBefore)
	}
	if p := parent.task.Pid(); p != pid {
		t.Errorf("parent's pid changed: %d -> %d", pid, p)
	}
	st, err := parent.task.Status(ctx)
	if err != nil || st.Status != containerd.Running {
		t.Fatalf("parent after the move: %v %v", st.Status, err)
	}
	parent.waitLine(t, ctx, len(parent.lines(t)), "tick ")
	// The exec session still runs and prints.
	lines := func() int { l, _ := harness.ReadLines(execLog); return len(l) }
	n := lines()
	if _, err := harness.WaitLine(ctx, execLog, n, func(string) bool { return true }); err != nil {
		t.Errorf("exec session after the move: %v", err)
	}
	if err := proc.Kill(ctx, syscall.SIGKILL); err != nil {
		t.Error(err)
	}
	<-execExit
	proc.Delete(ctx)

	// Writes stay apart both ways.
	parent.signal(t, ctx, syscall.SIGUSR2, "wrote ")
	if v := parent.signal(t, ctx, syscall.SIGUSR1, "verify "); v != "verify ok pages=16384 writes=1" {
		t.Errorf("parent: %q", v)
	}
	if v := fork.signal(t, ctx, syscall.SIGUSR1, "verify "); v != "verify ok pages=16384 writes=0" {
		t.Errorf("fork: %q", v)
	}
	fork.signal(t, ctx, syscall.SIGUSR2, "wrote ")
	fork.signal(t, ctx, syscall.SIGUSR2, "wrote ")
	if v := parent.signal(t, ctx, syscall.SIGUSR1, "verify "); v != "verify ok pages=16384 writes=1" {
		t.Errorf("parent after its fork wrote: %q", v)
	}

	// Later forks of the parent are deltas.
	store, err := memfile.OpenStore(filepath.Join(e.Root, "mem"))
	if err != nil {
		t.Fatal(err)
	}
	for i := 1; i <= 3; i++ {
		parent.signal(t, ctx, syscall.SIGUSR2, "wrote ")
		before := tmpfsBytes(t, e.Root)
		res, err := lf.Fork(ctx, parent.id, 1, e.logIO())
		if err != nil {
			t.Fatal(err)
		}
		f := e.forks(res)[0]
		checkContinues(t, ctx, parent, f)
		grew := tmpfsBytes(t, e.Root) - before
		t.Logf("fork %d: paused %v, tmpfs +%d kB", i+1, res.Paused, grew>>10)
		if grew > 4<<20 {
			t.Errorf("fork %d of the moved parent added %d kB to the tmpfs: not a delta", i+1, grew>>10)
		}
		want := fmt.Sprintf("verify ok pages=16384 writes=%d", i+1)
		if v := f.signal(t, ctx, syscall.SIGUSR1, "verify "); v != want {
			t.Errorf("fork %d: %q, want %q", i+1, v, want)
		}
	}
	if v := parent.signal(t, ctx, syscall.SIGUSR1, "verify "); v != "verify ok pages=16384 writes=4" {
		t.Errorf("parent at the end: %q", v)
	}
	holders, err := store.Holders(res.Family)
	if err != nil {
		t.Fatal(err)
	}
	moved := false
	for h := range holders {
		moved = moved || strings.HasPrefix(h, "moved:"+e.Namespace+"/"+parent.id+"/")
	}
	if !moved {
		t.Errorf("the moved parent holds no reference on its memory file: %v", holders)
	}
}
