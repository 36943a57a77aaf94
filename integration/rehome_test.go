package integration

import (
	"bufio"
	"bytes"
	"context"
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/containerd/cgroups/v3"
	tasksapi "github.com/containerd/containerd/api/services/tasks/v1"
	containerd "github.com/containerd/containerd/v2/client"
	"github.com/containerd/containerd/v2/pkg/cio"
	specs "github.com/opencontainers/runtime-spec/specs-go"

	"github.com/lazyfork/lazyfork/api"
	lfclient "github.com/lazyfork/lazyfork/client"
	"github.com/lazyfork/lazyfork/integration/harness"
	"github.com/lazyfork/lazyfork/internal/procfs"
	"github.com/lazyfork/lazyfork/memfile"
	lazyforkv1 "github.com/lazyfork/lazyfork/proto/lazyfork/v1"
	"github.com/lazyfork/lazyfork/shim"
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
	for _, p := range memFiles(t, root) {
		if fi, err := os.Stat(p); err == nil {
			n += fi.Sys().(*syscall.Stat_t).Blocks * 512
		}
	}
	return n
}

// memFiles lists the memory files of a stack rooted at root.
func memFiles(t *testing.T, root string) []string {
	t.Helper()
	var out []string
	filepath.Walk(filepath.Join(root, "mem"), func(p string, fi os.FileInfo, err error) error {
		if err == nil && fi.Mode().IsRegular() && !strings.Contains(p, "/.views/") {
			out = append(out, p)
		}
		return nil
	})
	return out
}

// TestRehome: a running container forked the first time moves onto its
// snapshot's memory file (issue 11). It keeps its task, pid, exec sessions
// and count; its anonymous memory falls to a few MB; its writes and its
// fork's stay apart; and its next snapshots are deltas: no new memory file,
// a small image.
func TestRehome(t *testing.T) {
	// A precopy for its 64 MiB heap too (by default from 128 MiB).
	e, ctx, img := startLFPython(t, "LAZYFORK_PRECOPY=16M")
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
	// The move ran the small helper binary, not the shim's own.
	if l := e.Log(); !strings.Contains(l, "helper=lazyfork-rehome") {
		t.Errorf("the move did not run lazyfork-rehome (shim log: %q)", grepLines(l, "moved onto memory file"))
	}
	// The move took the precopy made at the client's snapshot intent,
	// before the freeze (LAZYFORK_PRECOPY, on by default): the heap's
	// VMAs came from it, only what the parent wrote since on top.
	if l := grepLines(e.Log(), "moved onto memory file"); !regexp.MustCompile(`precopied_vmas=[1-9]`).MatchString(l) {
		t.Errorf("the first move took no precopy (move: %q; precopy: %q)", l, grepLines(e.Log(), "precopy"))
	}
	// The parent was frozen twice for that snapshot: for the precopy's
	// injection, and for the dump. Its pause is the sum.
	ckpt := grepLines(e.Log(), "checkpoint rewritten")
	if frozen, thaw := logDuration(t, ckpt, "precopy_frozen"), logDuration(t, ckpt, "until_thaw"); frozen <= 0 || res.Paused < frozen+thaw {
		t.Errorf("first fork paused %v: want at least the precopy's freeze (%v) and the checkpoint's until its thaw (%v): %q", res.Paused, frozen, thaw, ckpt)
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

	// Nine later forks of the parent (ten in all, each after it wrote), as
	// an agent forking at every step does: each is a delta.
	store, err := memfile.OpenStore(filepath.Join(e.Root, "mem"))
	if err != nil {
		t.Fatal(err)
	}
	const later = 9
	for i := 1; i <= later; i++ {
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
		// One marker page and what the interpreter dirtied meanwhile
		// (about 350 kB here); a whole heap is 64 MiB.
		if grew > 1<<20 {
			t.Errorf("fork %d of the moved parent added %d kB to the tmpfs: not a delta", i+1, grew>>10)
		}
		want := fmt.Sprintf("verify ok pages=16384 writes=%d", i+1)
		if v := f.signal(t, ctx, syscall.SIGUSR1, "verify "); v != want {
			t.Errorf("fork %d: %q, want %q", i+1, v, want)
		}
		// What the parent wrote since its last move moved too: neither it
		// nor its fork holds it privately.
		anon := statusKB(t, pid, "RssAnon")
		fmem := memoryUsage(t, ctx, res.Forks[0].Container)
		t.Logf("fork %d: parent RssAnon %d kB, fork's cgroup %d kB", i+1, anon, fmem>>10)
		if anon > 2<<10 {
			t.Errorf("parent holds %d kB privately after its fork %d", anon, i+1)
		}
		if fmem > 3<<20 {
			t.Errorf("fork %d holds %d kB: it restored the parent's writes as private memory", i+1, fmem>>10)
		}
	}
	if v, want := parent.signal(t, ctx, syscall.SIGUSR1, "verify "), fmt.Sprintf("verify ok pages=16384 writes=%d", later+1); v != want {
		t.Errorf("parent at the end: %q, want %q", v, want)
	}
	// The later checkpoints left the parent on its files (patched deltas,
	// on by default), its writes patches of its forks, but for a move
	// once it held 2 MiB of them twice (its writes come in few runs).
	ckpts := strings.Split(grepLines(e.Log(), "checkpoint rewritten"), "\n")
	patched := 0
	for _, l := range ckpts {
		if strings.Contains(l, "patched=true") {
			patched++
		}
	}
	moves := strings.Split(grepLines(e.Log(), "moved onto memory file"), "\n")
	if len(ckpts) != later+1 || patched < later/2 || patched+len(moves) != later+1 || strings.Contains(ckpts[0], "patched=true") {
		t.Errorf("%d of %d checkpoints were patched deltas and %d moved, want the first moved and most others patched:\n%s",
			patched, len(ckpts), len(moves), strings.Join(ckpts, "\n"))
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

// memoryCgroupFile is a file of a container's memory cgroup (v1 or v2 name).
func memoryCgroupFile(t *testing.T, ctx context.Context, ctr containerd.Container, v1, v2 string) string {
	t.Helper()
	spec, err := ctr.Spec(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if cgroups.Mode() == cgroups.Unified {
		return filepath.Join("/sys/fs/cgroup", spec.Linux.CgroupsPath, v2)
	}
	return filepath.Join("/sys/fs/cgroup/memory", spec.Linux.CgroupsPath, v1)
}

// shmemOf is the tmpfs memory charged to a container's cgroup.
func shmemOf(t *testing.T, ctx context.Context, ctr containerd.Container) uint64 {
	t.Helper()
	b, err := os.ReadFile(memoryCgroupFile(t, ctx, ctr, "memory.stat", "memory.stat"))
	if err != nil {
		t.Fatal(err)
	}
	for _, l := range strings.Split(string(b), "\n") {
		if v, ok := strings.CutPrefix(l, "shmem "); ok {
			n, _ := strconv.ParseUint(v, 10, 64)
			return n
		}
	}
	return 0
}

// TestRehomeMemoryLimit: the moved memory file is charged to the container
// whose memory it holds, so its limit bounds its snapshots: a parent with a
// limit a little above its heap moves and forks; a parent with no headroom
// left gets a clear error and keeps running, unmoved (issue 11, point 4).
//
// The stack runs with LAZYFORK_PATCH_DELTAS=off, so that every snapshot
// moves the parent (TestRehomePatchedDeltas has the default).
func TestRehomeMemoryLimit(t *testing.T) {
	e, ctx, img := startLFPython(t, "LAZYFORK_PATCH_DELTAS=off") // a move at every snapshot
	lf := e.lfClient()

	fits := e.startCounter(t, ctx, img, "fits-"+lfRandom(3), 64)
	fitsCtr, err := e.Client().LoadContainer(ctx, fits.id)
	if err != nil {
		t.Fatal(err)
	}
	usage := memoryUsage(t, ctx, fitsCtr)
	limit := usage + 24<<20
	if err := os.WriteFile(memoryCgroupFile(t, ctx, fitsCtr, "memory.limit_in_bytes", "memory.max"), []byte(strconv.FormatUint(limit, 10)), 0); err != nil {
		t.Fatal(err)
	}
	res, err := lf.Fork(ctx, fits.id, 1, e.logIO())
	if err != nil {
		t.Fatalf("fork of a parent %d MiB under its limit: %v", (limit-usage)>>20, err)
	}
	checkContinues(t, ctx, fits, e.forks(res)[0])
	shmem := shmemOf(t, ctx, fitsCtr)
	t.Logf("parent usage %d MiB, limit %d MiB; after the move: usage %d MiB, of it shmem (its memory file) %d MiB, RssAnon %d kB",
		usage>>20, limit>>20, memoryUsage(t, ctx, fitsCtr)>>20, shmem>>20, statusKB(t, fits.task.Pid(), "RssAnon"))
	if shmem < 60<<20 {
		t.Errorf("the parent's cgroup holds %d MiB of tmpfs after its move, want its 64 MiB heap charged to it", shmem>>20)
	}
	if v := fits.signal(t, ctx, syscall.SIGUSR1, "verify "); v != "verify ok pages=16384 writes=0" {
		t.Errorf("parent after the move: %q", v)
	}
	// lazyfork mem (client.Families) says so.
	spec, err := fitsCtr.Spec(ctx)
	if err != nil {
		t.Fatal(err)
	}
	fams, err := lf.Families()
	if err != nil {
		t.Fatal(err)
	}
	charged := false
	for _, f := range fams {
		for _, cg := range f.ChargedTo {
			charged = charged || cg == spec.Linux.CgroupsPath
		}
	}
	if !charged {
		t.Errorf("no memory file recorded as charged to the parent's cgroup %s: %+v", spec.Linux.CgroupsPath, fams)
	}

	// A later move refused: the moved parent, written since, has no
	// headroom left. runc's checkpoint, started beside the move and held
	// at its gate, ends before CRIU; the fork fails naming the limit, the
	// parent runs on with its write, and the call leaves no snapshot.
	snapshots := e.snapshotsLeft(t)
	usage = memoryUsage(t, ctx, fitsCtr)
	if err := os.WriteFile(memoryCgroupFile(t, ctx, fitsCtr, "memory.limit_in_bytes", "memory.max"), []byte(strconv.FormatUint(usage+1<<20, 10)), 0); err != nil {
		t.Fatal(err)
	}
	fits.signal(t, ctx, syscall.SIGUSR2, "wrote ")
	if _, err := lf.Fork(ctx, fits.id, 1, e.logIO()); err == nil || !strings.Contains(err.Error(), "memory limit") {
		t.Fatalf("later fork of a moved parent at its memory limit: %v, want a clear error naming the limit", err)
	}
	if st, err := fits.task.Status(ctx); err != nil || st.Status != containerd.Running {
		t.Fatalf("moved parent after the refused snapshot: %v %v", st.Status, err)
	}
	fits.waitLine(t, ctx, len(fits.lines(t)), "tick ")
	if v := fits.signal(t, ctx, syscall.SIGUSR1, "verify "); v != "verify ok pages=16384 writes=1" {
		t.Errorf("moved parent after the refused snapshot: %q", v)
	}
	if left := e.snapshotsLeft(t); !slices.Equal(left, snapshots) {
		t.Errorf("snapshots after the refused call: %q, before it: %q", left, snapshots)
	}

	full := e.startCounter(t, ctx, img, "full-"+lfRandom(3), 64)
	fullCtr, err := e.Client().LoadContainer(ctx, full.id)
	if err != nil {
		t.Fatal(err)
	}
	usage = memoryUsage(t, ctx, fullCtr)
	if err := os.WriteFile(memoryCgroupFile(t, ctx, fullCtr, "memory.limit_in_bytes", "memory.max"), []byte(strconv.FormatUint(usage+1<<20, 10)), 0); err != nil {
		t.Fatal(err)
	}
	anon := statusKB(t, full.task.Pid(), "RssAnon")
	_, err = lf.Fork(ctx, full.id, 1, e.logIO())
	if err == nil || !strings.Contains(err.Error(), "memory limit") {
		t.Fatalf("fork of a parent at its memory limit: %v, want a clear error naming the limit", err)
	}
	t.Logf("at its limit: %v", err)
	st, err := full.task.Status(ctx)
	if err != nil || st.Status != containerd.Running {
		t.Fatalf("parent after the refused snapshot: %v %v", st.Status, err)
	}
	full.waitLine(t, ctx, len(full.lines(t)), "tick ")
	if v := full.signal(t, ctx, syscall.SIGUSR1, "verify "); v != "verify ok pages=16384 writes=0" {
		t.Errorf("parent after the refused snapshot: %q", v)
	}
	if a := statusKB(t, full.task.Pid(), "RssAnon"); a < anon/2 {
		t.Errorf("the refused parent moved anyway: RssAnon %d kB, was %d kB", a, anon)
	}
}

// TestRehomeHelperKilled: the move's helper dies (SIGKILL) with part of the
// tree moved. The parent runs on, each part moved or as it was, its memory
// verifies, and it forks now and again later (issue 11, point 5).
func TestRehomeHelperKilled(t *testing.T) {
	forkPastFailedMove(t, []string{"LAZYFORK_REHOME_FAILPOINT=die-mid-move"}, 2, "move onto memory file incomplete")
}

// TestRehomeHelperKilledAfterPreCopy: the same, with the first move's helper
// the one that made a precopy (its userfaultfds die with it).
func TestRehomeHelperKilledAfterPreCopy(t *testing.T) {
	e := forkPastFailedMove(t, []string{"LAZYFORK_REHOME_FAILPOINT=die-mid-move", "LAZYFORK_PRECOPY=16M"}, 2, "move onto memory file incomplete")
	if l := grepLines(e.Log(), "lazyfork: precopy"); !regexp.MustCompile(`precopied=[1-9]`).MatchString(l) {
		t.Errorf("no precopy before the move: %q", l)
	}
}

// TestRehomePreCopyKeptFromOtherMoves: a precopy waits for its own
// container's move. Of two forks of one call (one shim), the first
// allocates 64 MiB of its own (it has not moved) and precopies at its
// snapshot intent; the second's snapshot, made meanwhile, moves on another
// helper; the first's move then takes its precopy. (A precopy's helper used
// to wait as the shim's standby helper: the second's move took it and
// dropped the precopy.)
func TestRehomePreCopyKeptFromOtherMoves(t *testing.T) {
	e, ctx, img := startLFPython(t, "LAZYFORK_PRECOPY=16M")
	lf := e.lfClient()
	parent := e.startCounter(t, ctx, img, "prekeep-"+lfRandom(3), 16, "--grow-per-signal", "64")
	res, err := lf.Fork(ctx, parent.id, 2, e.logIO())
	if err != nil {
		t.Fatal(err)
	}
	forks := e.forks(res)
	grower, other := forks[0], forks[1]
	if a, b := parentOf(int(grower.task.Pid())), parentOf(int(other.task.Pid())); a != b {
		t.Fatalf("the forks of one call run under shims %d and %d, want one", a, b)
	}
	if w := grower.signal(t, ctx, syscall.SIGUSR2, "wrote "); !strings.HasSuffix(w, "writes=1") || !slices.Contains(grower.lines(t), "grew mib=64 total_mib=64") {
		t.Fatalf("the fork did not grow: %q", w)
	}
	sendSnapshotIntent(t, ctx, e, grower.id)
	precopied := regexp.MustCompile(`id=` + regexp.QuoteMeta(grower.id) + ` .*precopied=[1-9]`)
	waitFor(t, "the fork's precopy", time.Minute, func() bool { return precopied.MatchString(grepLines(e.Log(), "lazyfork: precopy")) })
	if _, err := lf.Fork(ctx, other.id, 1, e.logIO()); err != nil {
		t.Fatal(err)
	}
	res, err = lf.Fork(ctx, grower.id, 1, e.logIO())
	if err != nil {
		t.Fatal(err)
	}
	forkOfFork := e.forks(res)[0]
	checkContinues(t, ctx, grower, forkOfFork)
	moved := regexp.MustCompile(`id=` + regexp.QuoteMeta(grower.id) + ` .*precopied_vmas=([0-9]+)`).FindStringSubmatch(grepLines(e.Log(), "moved onto memory file"))
	if moved == nil || moved[1] == "0" {
		t.Errorf("the fork's move did not take its precopy (%v): %q", moved, grepLines(e.Log(), "memory file"))
	}
	for _, c := range []*counter{grower, forkOfFork} {
		if v := c.signal(t, ctx, syscall.SIGUSR1, "verify "); v != "verify ok pages=4096 writes=1" {
			t.Errorf("%s: %q", c.id, v)
		}
	}
	for _, c := range []*counter{parent, other} {
		if v := c.signal(t, ctx, syscall.SIGUSR1, "verify "); v != "verify ok pages=4096 writes=0" {
			t.Errorf("%s: %q", c.id, v)
		}
	}
}

// sendSnapshotIntent tells container id's shim, as the client does before a
// fork's pause, that one fork's snapshot follows.
func sendSnapshotIntent(t *testing.T, ctx context.Context, e *lfEnv, id string) {
	t.Helper()
	res, err := api.MarshalSnapshotIntent(&lazyforkv1.SnapshotIntent{Forks: 1, FreezeInShim: true})
	if err == nil {
		_, err = e.Client().TaskService().Update(ctx, &tasksapi.UpdateTaskRequest{ContainerID: id, Resources: res})
	}
	if err != nil {
		t.Fatalf("snapshot intent for %s: %v", id, err)
	}
}

// TestRehomeHelperHangs: a move's helper that hangs with part of the tree
// moved is killed after the restore timeout; the fork goes on from the
// parent as it stands, and the parent runs on, its heap whole.
func TestRehomeHelperHangs(t *testing.T) {
	forkPastFailedMove(t, []string{"LAZYFORK_REHOME_FAILPOINT=hang-mid-move", "LAZYFORK_RESTORE_TIMEOUT=3s"}, 1, "did not finish within 3s")
}

// forkPastFailedMove forks a 64 MiB counter calls times on a stack whose
// move helper fails as env makes it: each fork continues the count with its
// whole heap, the parent runs on with its heap whole, and the shim's log
// says what failed (logged).
func forkPastFailedMove(t *testing.T, env []string, calls int, logged string) *lfEnv {
	t.Helper()
	e, ctx, img := startLFPython(t, env...)
	lf := e.lfClient()
	parent := e.startCounter(t, ctx, img, "failmove-"+lfRandom(3), 64)
	for i := 1; i <= calls; i++ {
		res, err := lf.Fork(ctx, parent.id, 1, e.logIO())
		if err != nil {
			t.Fatalf("fork %d with the move's helper failing (%v): %v", i, env, err)
		}
		f := e.forks(res)[0]
		checkContinues(t, ctx, parent, f)
		if v := f.signal(t, ctx, syscall.SIGUSR1, "verify "); v != "verify ok pages=16384 writes=0" {
			t.Errorf("fork %d: %q", i, v)
		}
	}
	st, err := parent.task.Status(ctx)
	if err != nil || st.Status != containerd.Running {
		t.Fatalf("parent: %v %v", st.Status, err)
	}
	parent.waitLine(t, ctx, len(parent.lines(t)), "tick ")
	if v := parent.signal(t, ctx, syscall.SIGUSR1, "verify "); v != "verify ok pages=16384 writes=0" {
		t.Errorf("parent: %q", v)
	}
	if l := e.Log(); !strings.Contains(l, logged) {
		t.Errorf("the shim did not report the failed move (%q): %q", logged, grepLines(l, "memory file"))
	}
	return e
}

// TestRehomeFreesReplacedPages: a moved parent that writes new pages moves
// them onto each snapshot's new file; the older file's copies of those pages
// are then read by nobody once the forks and snapshots that held it are gone,
// and they are freed (fallocate punch), so a parent forked again and again
// does not keep two copies of every page it wrote. Freed only where nothing
// can read them: the files an older fork holds keep every page, and the
// parent, the older forks and a fork made afterwards verify their whole heap.
//
// The stack runs with LAZYFORK_PATCH_DELTAS=off: with patched deltas the
// parent moves only to consolidate, and holds its last snapshot's patches
// (what it wrote since its last move) for its next one, which
// TestRehomePatchedDeltas checks.
func TestRehomeFreesReplacedPages(t *testing.T) {
	e, ctx, img := startLFPython(t, "LAZYFORK_PATCH_DELTAS=off") // a move at every snapshot
	lf := e.lfClient()
	parent := e.startCounter(t, ctx, img, "punch-"+lfRandom(3), 64)
	// What a call leaves is measured as the memory files' pages that no
	// process maps: the pages the parent wrote since its last snapshot
	// replace older files' pages, which nothing reads once the fork and
	// snapshot are gone. (The tmpfs as a whole also grows by what the
	// interpreter newly allocates, a new arena now and then.)
	unmapped := func() int64 {
		t.Helper()
		n, err := memfile.UnmappedData(memFiles(t, e.Root))
		if err != nil {
			t.Fatal(err)
		}
		return n
	}
	forkAndDrop := func(call string) int64 {
		t.Helper()
		parent.signal(t, ctx, syscall.SIGUSR2, "wrote ")
		before, tmpfsBefore := unmapped(), tmpfsBytes(t, e.Root)
		res, err := lf.Fork(ctx, parent.id, 1, e.logIO())
		if err != nil {
			t.Fatal(err)
		}
		checkContinues(t, ctx, parent, e.forks(res)[0])
		if err := lf.Delete(ctx, res.Forks[0].Container.ID()); err != nil {
			t.Fatal(err)
		}
		if err := lf.RemoveSnapshot(ctx, res.Snapshot); err != nil {
			t.Fatal(err)
		}
		// Gone means its reference too: a fork's shim releases it as it
		// exits, which containerd's cleanup of that shim may finish after
		// Delete returns; the next call frees only what nothing holds.
		store, err := memfile.OpenStore(filepath.Join(e.Root, "mem"))
		if err != nil {
			t.Fatal(err)
		}
		fork := "container:" + e.Namespace + "/" + res.Forks[0].Container.ID()
		waitFor(t, "the dropped fork's reference on its files gone", 30*time.Second, func() bool {
			hs, err := store.Holders(res.Family)
			_, held := hs[fork]
			return err == nil && !held
		})
		g := unmapped() - before
		t.Logf("%s: unmapped pages %+d kB, tmpfs %+d kB", call, g>>10, (tmpfsBytes(t, e.Root)-tmpfsBefore)>>10)
		return g
	}
	forkAndDrop("call 1") // the parent moves onto its memory file
	var grew int64
	for i := 2; i <= 6; i++ {
		grew += forkAndDrop(fmt.Sprintf("call %d", i))
	}
	// Each call's new file holds what the interpreter and the write dirtied
	// (300-400 kB here); unfreed, the same pages of older files would stay.
	if grew > 256<<10 {
		t.Errorf("five later snapshots of the parent, their forks and snapshots gone, left %d kB of memory-file pages no process maps: the replaced pages were not freed", grew>>10)
	}
	// With older forks alive, the files they hold keep every page.
	parent.signal(t, ctx, syscall.SIGUSR2, "wrote ")
	res, err := lf.Fork(ctx, parent.id, 2, e.logIO())
	if err != nil {
		t.Fatal(err)
	}
	kept := e.forks(res)
	for i := 0; i < 2; i++ {
		forkAndDrop("with older forks alive")
	}
	writes := 9 // one per SIGUSR2 so far
	want := fmt.Sprintf("verify ok pages=16384 writes=%d", writes)
	if v := parent.signal(t, ctx, syscall.SIGUSR1, "verify "); v != want {
		t.Errorf("parent: %q, want %q", v, want)
	}
	for _, f := range kept {
		if v, w := f.signal(t, ctx, syscall.SIGUSR1, "verify "), fmt.Sprintf("verify ok pages=16384 writes=%d", 7); v != w {
			t.Errorf("older fork %s: %q, want %q", f.id, v, w)
		}
	}
	res, err = lf.Fork(ctx, parent.id, 1, e.logIO())
	if err != nil {
		t.Fatal(err)
	}
	if v := e.forks(res)[0].signal(t, ctx, syscall.SIGUSR1, "verify "); v != want {
		t.Errorf("a fork made after the frees: %q, want %q", v, want)
	}
}

// grepLines returns the lines of s that contain sub.
func grepLines(s, sub string) string {
	var out []string
	for _, l := range strings.Split(s, "\n") {
		if strings.Contains(l, sub) {
			out = append(out, l)
		}
	}
	return strings.Join(out, "\n")
}

// mapCount is how many mappings process pid has.
func mapCount(t *testing.T, pid uint32) int {
	t.Helper()
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/maps", pid))
	if err != nil {
		t.Fatal(err)
	}
	return bytes.Count(b, []byte("\n"))
}

// seccompFilters is the number of seccomp filters process pid runs under.
func seccompFilters(t *testing.T, pid uint32) int {
	t.Helper()
	n, err := procfs.SeccompFilters(int(pid))
	if err != nil {
		t.Fatal(err)
	}
	return n
}

// TestRehomeSpreadWrites: a parent that writes single pages all over its
// heap between snapshots gets a mapping per written page at each move (up to
// 512 per mapping), in it and in every fork restored from its later dumps.
// Once its moves made 512 such patches (shim's consolidateAfter), the next
// call's Pause prepares a consolidation and its move maps the heap whole
// again: the parent's mappings fall back, the fork made then has as
// few, and every copy's heap verifies, the fork made before the
// fragmentation (whose file the consolidation copied from) included. Forks
// are restored only where the mappings are few: CRIU 4.1.1 now and then dies
// restoring a task with hundreds of file mappings (docs, Known limits).
//
// The stack runs with LAZYFORK_PATCH_DELTAS=off, so that every snapshot
// moves the parent (TestRehomePatchedDeltas has the default).
func TestRehomeSpreadWrites(t *testing.T) {
	e, ctx, img := startLFPython(t, "LAZYFORK_PATCH_DELTAS=off") // a move at every snapshot
	lf := e.lfClient()
	// 512 pages 7919 apart in a 96 MiB heap: each an island of its own,
	// so each call's move makes 512 patches of the heap's mapping.
	const heapMiB, perCall, calls = 96, 512, 3
	parent := e.startCounter(t, ctx, img, "spread-"+lfRandom(3), heapMiB, "--writes-per-signal", strconv.Itoa(perCall))
	task := parent.task
	fork := func() (*counter, *lfclient.Result) {
		t.Helper()
		res, err := lf.Fork(ctx, parent.id, 1, e.logIO(), lfclient.KeepSnapshot())
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { lf.RemoveSnapshot(context.WithoutCancel(ctx), res.Snapshot) })
		f := e.forks(res)[0]
		checkContinues(t, ctx, parent, f)
		return f, res
	}
	first, _ := fork() // the parent moves onto its memory file
	parentMaps := []int{mapCount(t, task.Pid())}
	// Its first move guarded its heap; the patches and the consolidation
	// after lie inside, and add no filter (a live process cannot drop one:
	// a guard per move stacked up to the kernel's limit, some 30 moves).
	// One more is allowed: the interpreter may map new memory meanwhile,
	// which a move guards with a filter of its own.
	filters := seccompFilters(t, task.Pid())
	var last *counter
	var lastRes *lfclient.Result
	var callLog string // the shim's lines during the last call
	for call := 2; call <= calls; call++ {
		parent.signal(t, ctx, syscall.SIGUSR2, "wrote ")
		if call == calls {
			logFrom := len(e.Log())
			last, lastRes = fork()
			callLog = e.Log()[logFrom:]
		} else {
			res, err := lf.Checkpoint(ctx, parent.id)
			if err != nil {
				t.Fatalf("call %d: %v", call, err)
			}
			if err := lf.RemoveSnapshot(ctx, res.Snapshot); err != nil {
				t.Fatal(err)
			}
		}
		parentMaps = append(parentMaps, mapCount(t, task.Pid()))
		t.Logf("call %d: parent %d mappings", call, parentMaps[call-1])
		if n := seccompFilters(t, task.Pid()); n > filters+1 {
			t.Errorf("call %d: the parent runs under %d seccomp filters, %d after its first move: moves stacked guards", call, n, filters)
		}
	}
	if grew := parentMaps[1] - parentMaps[0]; grew < 1000 {
		t.Fatalf("a call of %d spread writes grew the parent by %d mappings: the test no longer fragments it", perCall, grew)
	}
	// Call 2 made 512 patches; the consolidation prepared in call 3's
	// Pause is mapped at its move, with that call's pages on top.
	peak := slices.Max(parentMaps)
	if got := parentMaps[calls-1]; got > peak-1000 {
		t.Errorf("the parent has %d mappings after call %d, %d at most before (per call: %v): its fragmented heap was not consolidated", got, calls, peak, parentMaps)
	}
	// The consolidating call copied the heap in its own Pause (the parent
	// running), then its move mapped it; the pause reported is the shim's
	// account of the freeze, which begins after the copy.
	prepared := strings.Index(callLog, "lazyfork: consolidation prepared")
	moved := strings.Index(callLog, "lazyfork: moved onto memory file")
	if prepared < 0 || moved < prepared {
		t.Errorf("call %d: the shim's log does not show the consolidation prepared in the call, before its move (prepared at %d, moved at %d of %d bytes)",
			calls, prepared, moved, len(callLog))
	} else if l := grepLines(callLog[moved:], "moved onto memory file"); !strings.Contains(l, "preloaded=true") {
		// Its regions went to the waiting helper before the freeze.
		t.Errorf("call %d: the consolidating move's regions were not preloaded: %q", calls, l)
	}
	snap, err := lf.Node().Snapshot(ctx, lastRes.Snapshot)
	if err != nil {
		t.Fatal(err)
	}
	if snap.Paused <= 0 || lastRes.Paused != snap.Paused {
		t.Errorf("call %d: the snapshot records a pause of %v, the fork reports %v: want the shim's own", calls, snap.Paused, lastRes.Paused)
	}
	if got := mapCount(t, last.task.Pid()); got > peak-1000 {
		t.Errorf("the fork of call %d has %d mappings, the parent had %d: it carries the fragments", calls, got, peak)
	}
	pages := heapMiB << 20 / 4096
	for c, writes := range map[*counter]int{parent: (calls - 1) * perCall, first: 0, last: (calls - 1) * perCall} {
		want := fmt.Sprintf("verify ok pages=%d writes=%d", pages, writes)
		if v := c.signal(t, ctx, syscall.SIGUSR1, "verify "); v != want {
			t.Errorf("%s: %q, want %q", c.id, v, want)
		}
	}
}

// TestRehomeManyForksConsolidate: a call of many forks tells the shim how
// many (lazyforkv1.SnapshotIntent, a task update before its pause). Each
// fork maps the dump's heap, patches and all, so with the parent's patches
// times the forks past the bound, and the parent holding its files alone,
// the call consolidates early: in its Pause, the parent running, as at the
// bound. The forks then map the heap whole, and the replaced pieces are
// freed, so the copy leaves no second heap on the tmpfs.
//
// The stack runs with LAZYFORK_PATCH_DELTAS=off, so that every snapshot
// moves the parent (TestRehomePatchedDeltas has the default).
func TestRehomeManyForksConsolidate(t *testing.T) {
	e, ctx, img := startLFPython(t, "LAZYFORK_PATCH_DELTAS=off") // a move at every snapshot
	lf := e.lfClient()
	// As in TestRehomeSpreadWrites, but each call's move makes 256
	// patches, short of the bound (512) for a call of one fork.
	const heapMiB, perCall, forks = 96, 256, 3
	parent := e.startCounter(t, ctx, img, "manyforks-"+lfRandom(3), heapMiB, "--writes-per-signal", strconv.Itoa(perCall))
	task := parent.task
	checkpoint := func() {
		t.Helper()
		res, err := lf.Checkpoint(ctx, parent.id)
		if err != nil {
			t.Fatal(err)
		}
		if err := lf.RemoveSnapshot(ctx, res.Snapshot); err != nil {
			t.Fatal(err)
		}
	}
	checkpoint() // the parent moves onto its memory file
	moved := mapCount(t, task.Pid())
	parent.signal(t, ctx, syscall.SIGUSR2, "wrote ")
	checkpoint() // 256 patches
	fragmented := mapCount(t, task.Pid())
	if fragmented-moved < 400 {
		t.Fatalf("%d spread writes grew the parent from %d to %d mappings: the test no longer fragments it", perCall, moved, fragmented)
	}

	parent.signal(t, ctx, syscall.SIGUSR2, "wrote ")
	tmpfsBefore := tmpfsBytes(t, e.Root)
	logFrom := len(e.Log())
	res, err := lf.Fork(ctx, parent.id, forks, e.logIO())
	if err != nil {
		t.Fatal(err)
	}
	callLog := e.Log()[logFrom:]
	prepared := strings.Index(callLog, "lazyfork: consolidation prepared")
	movedAt := strings.Index(callLog, "lazyfork: moved onto memory file")
	if prepared < 0 || movedAt < prepared {
		t.Fatalf("a call of %d forks after %d patches: the shim's log does not show a consolidation prepared before its move (prepared at %d, moved at %d)",
			forks, perCall, prepared, movedAt)
	}
	kids := e.forks(res)
	for _, f := range kids {
		checkContinues(t, ctx, parent, f)
		if got := mapCount(t, f.task.Pid()); got > fragmented-400 {
			t.Errorf("fork %s has %d mappings, the parent had %d fragmented and %d whole: it carries the patches", f.id, got, fragmented, moved)
		}
	}
	if got := mapCount(t, task.Pid()); got > fragmented-400 {
		t.Errorf("the parent has %d mappings after the call, %d before: its heap was not consolidated", got, fragmented)
	}
	// The pieces the copy replaced are freed (nothing but the parent held
	// them); kept, they would be a second heap.
	if grew := tmpfsBytes(t, e.Root) - tmpfsBefore; grew > heapMiB<<20/4 {
		t.Errorf("the consolidating call grew the memory files by %d MiB (heap %d MiB): the replaced pieces were not freed", grew>>20, heapMiB)
	}
	want := fmt.Sprintf("verify ok pages=%d writes=%d", heapMiB<<20/4096, 2*perCall)
	for _, c := range append(kids, parent) {
		if v := c.signal(t, ctx, syscall.SIGUSR1, "verify "); v != want {
			t.Errorf("%s: %q, want %q", c.id, v, want)
		}
	}
}

// TestRehomeStandbyHelper: the move of a parent's next snapshot runs on a
// helper the shim started beforehand (after the last checkpoint), so its
// start-up stays out of the pause. At most one waits per shim, in the
// shim's cgroups, and not past LAZYFORK_REHOME_STANDBY; LAZYFORK_REHOME_STANDBY=off
// starts none.
//
// The stack runs with LAZYFORK_PATCH_DELTAS=off, so that every snapshot
// moves the parent (TestRehomePatchedDeltas has the default).
func TestRehomeStandbyHelper(t *testing.T) {
	const wait = 8 * time.Second // the steps before its expiry take about a second
	e, ctx, img := startLFPython(t, "LAZYFORK_REHOME_STANDBY="+wait.String(), "LAZYFORK_PATCH_DELTAS=off")
	lf := e.lfClient()
	parent := e.startCounter(t, ctx, img, "standby-"+lfRandom(3), 16)
	shimPID := parentOf(int(parent.task.Pid()))
	if hs := rehomeHelpersOf(shimPID); len(hs) != 0 {
		t.Fatalf("helpers %v wait before any snapshot", hs)
	}
	fork := func() {
		t.Helper()
		res, err := lf.Fork(ctx, parent.id, 1, e.logIO())
		if err != nil {
			t.Fatal(err)
		}
		checkContinues(t, ctx, parent, e.forks(res)[0])
	}
	fork()
	// One waits for the next snapshot, in the shim's memory cgroup.
	first := waitRehomeHelpers(t, shimPID, 1)[0]
	if got, want := memoryCgroupPath(first), memoryCgroupPath(shimPID); got != want {
		t.Errorf("the standby helper is in memory cgroup %q, want the shim's %q", got, want)
	}
	// The next fork's move runs on it, and the next one waits.
	fork()
	moves := strings.Split(grepLines(e.Log(), "moved onto memory file"), "\n")
	if last := moves[len(moves)-1]; !strings.Contains(last, "standby=true") {
		t.Errorf("the second move did not run on the standby helper: %q", last)
	}
	if alive(first) {
		t.Errorf("the standby helper %d outlived the move it ran", first)
	}
	second := waitRehomeHelpers(t, shimPID, 1)[0]
	// A plain pause (a checkpoint may follow) keeps that one, out of the
	// parent's cgroups, and starts no other.
	if err := parent.task.Pause(ctx); err != nil {
		t.Fatal(err)
	}
	if got, want := memoryCgroupPath(second), memoryCgroupPath(shimPID); got != want {
		t.Errorf("the paused parent's standby helper is in memory cgroup %q, want the shim's %q", got, want)
	}
	if err := parent.task.Resume(ctx); err != nil {
		t.Fatal(err)
	}
	if hs := rehomeHelpersOf(shimPID); len(hs) != 1 || hs[0] != second {
		t.Errorf("after a pause and resume the shim's move helpers are %v, want only %d", hs, second)
	}
	parent.waitLine(t, ctx, len(parent.lines(t)), "tick ")
	// Unused, it goes after its wait.
	waitFor(t, fmt.Sprintf("the standby helper %d gone after %s unused", second, wait), 3*wait, func() bool { return !alive(second) })
	if hs := rehomeHelpersOf(shimPID); len(hs) != 0 {
		t.Errorf("move helpers %v wait after the standby expired", hs)
	}

	// Off: every move starts its own, none waits.
	off, offCtx, offImg := startLFPython(t, "LAZYFORK_REHOME_STANDBY=off")
	p := off.startCounter(t, offCtx, offImg, "nostandby-"+lfRandom(3), 16)
	res, err := off.lfClient().Fork(offCtx, p.id, 1, off.logIO())
	if err != nil {
		t.Fatal(err)
	}
	checkContinues(t, offCtx, p, off.forks(res)[0])
	time.Sleep(500 * time.Millisecond)
	if hs := rehomeHelpersOf(parentOf(int(p.task.Pid()))); len(hs) != 0 {
		t.Errorf("LAZYFORK_REHOME_STANDBY=off: move helpers %v wait after a fork", hs)
	}
	if l := grepLines(off.Log(), "moved onto memory file"); !strings.Contains(l, "standby=false") {
		t.Errorf("LAZYFORK_REHOME_STANDBY=off: the move ran on a standby helper: %q", l)
	}
}

// rehomeHelpersOf lists the move helpers that are children of process
// shim: lazyfork-rehome, or the shim's own binary run as the helper where
// that is missing.
func rehomeHelpersOf(shimPID int) []int {
	ents, _ := os.ReadDir("/proc")
	var out []int
	for _, e := range ents {
		pid, err := strconv.Atoi(e.Name())
		if err != nil || !alive(pid) || parentOf(pid) != shimPID {
			continue
		}
		b, err := os.ReadFile(fmt.Sprintf("/proc/%d/cmdline", pid))
		if err != nil {
			continue
		}
		args := strings.Split(strings.TrimSuffix(string(b), "\x00"), "\x00")
		if filepath.Base(args[0]) == "lazyfork-rehome" || len(args) == 3 && args[1] == shim.HookArg && args[2] == "rehome" {
			out = append(out, pid)
		}
	}
	return out
}

// parentOf is process pid's parent (0 if gone).
func parentOf(pid int) int {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return 0
	}
	// "pid (comm) state ppid ...": comm may hold spaces and parentheses.
	fs := strings.Fields(string(b[bytes.LastIndexByte(b, ')')+1:]))
	if len(fs) < 2 {
		return 0
	}
	ppid, _ := strconv.Atoi(fs[1])
	return ppid
}

// waitRehomeHelpers waits until shim has n move helpers, and returns them.
func waitRehomeHelpers(t *testing.T, shimPID, n int) []int {
	t.Helper()
	var hs []int
	waitFor(t, fmt.Sprintf("%d move helpers of shim %d", n, shimPID), 5*time.Second, func() bool {
		hs = rehomeHelpersOf(shimPID)
		return len(hs) == n
	})
	return hs
}

func memoryCgroupPath(pid int) string {
	p, _, _ := procfs.Cgroup(pid, "memory")
	return p
}

// alive reports whether process pid exists and is not a zombie.
func alive(pid int) bool {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return false
	}
	fs := strings.Fields(string(b[bytes.LastIndexByte(b, ')')+1:]))
	return len(fs) > 0 && fs[0] != "Z"
}

// logDuration is the duration field name of the first of the log lines (a
// shim log field, name=1.5ms), 0 if it has none.
func logDuration(t *testing.T, lines, name string) time.Duration {
	t.Helper()
	m := regexp.MustCompile(`\b` + name + `="?([0-9.]+[µnm]?s)`).FindStringSubmatch(lines)
	if m == nil {
		return 0
	}
	d, err := time.ParseDuration(m[1])
	if err != nil {
		t.Fatalf("%s=%s: %v", name, m[1], err)
	}
	return d
}

// TestRehomePatchedDeltas: with patched deltas (the default), a parent that
// moved at its first snapshot stays on its files at its later ones. A call
// after it wrote 256 pages spread over its heap leaves it with as few
// mappings as before (its writes are anonymous pages inside them, its dump
// small), and its snapshot gets those pages as patches of memory files, not
// as pages each fork restores privately. A snapshot with nothing written
// since maps the previous one's patches again and writes about nothing. With
// the patches past the bound (shim's consolidateAfter, 512), the next call's
// Pause prepares a consolidation and its move maps the heap whole with the
// written pages on top: the parent then holds nothing twice, and its fork
// has few mappings. Every copy's heap verifies.
func TestRehomePatchedDeltas(t *testing.T) {
	e, ctx, img := startLFPython(t)
	lf := e.lfClient()
	const heapMiB, perCall = 96, 256
	parent := e.startCounter(t, ctx, img, "patched-"+lfRandom(3), heapMiB, "--writes-per-signal", strconv.Itoa(perCall))
	pid := parent.task.Pid()
	var forks []*counter
	fork := func() string {
		t.Helper()
		from := len(e.Log())
		res, err := lf.Fork(ctx, parent.id, 1, e.logIO())
		if err != nil {
			t.Fatal(err)
		}
		f := e.forks(res)[0]
		checkContinues(t, ctx, parent, f)
		forks = append(forks, f)
		return e.Log()[from:]
	}
	checkpoint := func(call string) string {
		t.Helper()
		from := len(e.Log())
		before := tmpfsBytes(t, e.Root)
		res, err := lf.Checkpoint(ctx, parent.id)
		if err != nil {
			t.Fatal(err)
		}
		grew := tmpfsBytes(t, e.Root) - before
		// Gone before the next call: the parent itself holds the patches
		// its next snapshot maps again.
		if err := lf.RemoveSnapshot(ctx, res.Snapshot); err != nil {
			t.Fatal(err)
		}
		l := grepLines(e.Log()[from:], "checkpoint rewritten")
		t.Logf("call %s: parent %d mappings, RssAnon %d kB; tmpfs +%d kB; %s", call, mapCount(t, pid), statusKB(t, pid, "RssAnon"), grew>>10, l)
		if !strings.Contains(l, "patched=true") {
			t.Errorf("call %s was not a patched delta: %s", call, l)
		}
		// Its patches: the pages written, up to 3 clean ones joined
		// between two, and the interpreter's; nothing of the heap.
		if grew > 8<<20 {
			t.Errorf("call %s added %d kB to the tmpfs", call, grew>>10)
		}
		return l
	}
	fork() // the parent moves onto its memory file
	moved := mapCount(t, pid)
	anonMoved := statusKB(t, pid, "RssAnon")

	parent.signal(t, ctx, syscall.SIGUSR2, "wrote ")
	checkpoint("2")
	if maps := mapCount(t, pid); maps > moved+20 {
		t.Errorf("call 2 gave the parent %d mappings, %d before: it moved its writes", maps, moved)
	}
	// It keeps its 256 written pages (1 MiB) and what the interpreter wrote.
	if anon := statusKB(t, pid, "RssAnon"); anon < anonMoved+perCall*4 {
		t.Errorf("call 2: the parent holds %d kB privately, %d kB after its move: its writes are gone", anon, anonMoved)
	}
	store, err := memfile.OpenStore(filepath.Join(e.Root, "mem"))
	if err != nil {
		t.Fatal(err)
	}
	holders, err := store.Holders(parent.id)
	if err != nil {
		t.Fatal(err)
	}
	held := false
	for h := range holders {
		held = held || strings.HasPrefix(h, "patches:"+e.Namespace+"/"+parent.id+"/")
	}
	if !held {
		t.Errorf("after a patched snapshot, the parent holds no reference on its patches: %v", holders)
	}
	// Nothing written since: the previous snapshot's patches, mapped again.
	before := tmpfsBytes(t, e.Root)
	if l := checkpoint("2b"); strings.Contains(l, "pages_reused=0 ") {
		t.Errorf("call 2b did not reuse the previous patches: %s", l)
	}
	if grew := tmpfsBytes(t, e.Root) - before; grew > 1<<20 {
		t.Errorf("call 2b, with nothing written since call 2, added %d kB to the tmpfs", grew>>10)
	}
	parent.signal(t, ctx, syscall.SIGUSR2, "wrote ")
	checkpoint("3") // past the bound

	// Call 4: its Pause prepares a consolidation, its move maps the heap whole.
	parent.signal(t, ctx, syscall.SIGUSR2, "wrote ")
	callLog := fork()
	prepared := strings.Index(callLog, "lazyfork: consolidation prepared")
	movedAt := strings.Index(callLog, "lazyfork: moved onto memory file")
	if prepared < 0 || movedAt < prepared {
		t.Fatalf("call 4: the shim's log does not show a consolidation prepared before a move (prepared at %d, moved at %d):\n%s", prepared, movedAt, grepLines(callLog, "lazyfork:"))
	}
	if l := grepLines(callLog, "checkpoint rewritten"); strings.Contains(l, "patched=true") {
		t.Errorf("call 4 moved and still patched: %s", l)
	}
	maps, anon := mapCount(t, pid), statusKB(t, pid, "RssAnon")
	t.Logf("call 4: parent %d mappings, RssAnon %d kB", maps, anon)
	if anon > anonMoved+2<<10 {
		t.Errorf("call 4 consolidated, and the parent still holds %d kB privately (%d kB after its first move)", anon, anonMoved)
	}
	if maps > moved+20 {
		t.Errorf("call 4: the parent has %d mappings, %d after its first move", maps, moved)
	}
	if got := mapCount(t, forks[1].task.Pid()); got > moved+20 {
		t.Errorf("the fork of call 4 has %d mappings, the parent %d", got, moved)
	}

	// Call 5: patched again, on the consolidated file.
	parent.signal(t, ctx, syscall.SIGUSR2, "wrote ")
	checkpoint("5")

	pages := heapMiB << 20 / 4096
	for c, writes := range map[*counter]int{parent: 4 * perCall, forks[0]: 0, forks[1]: 3 * perCall} {
		want := fmt.Sprintf("verify ok pages=%d writes=%d", pages, writes)
		if v := c.signal(t, ctx, syscall.SIGUSR1, "verify "); v != want {
			t.Errorf("%s: %q, want %q", c.id, v, want)
		}
	}
}

// TestRehomePatchedAtMemoryLimit: a patched snapshot's patches are written
// from the container's memory cgroup, so its tmpfs pages are charged to the
// container (its shmem grows by them) and its limit bounds them: with room,
// the fork is made; with less than twice the patches' size left under its
// limit, the fork fails naming the limit, the parent runs on unharmed and no
// snapshot is left.
func TestRehomePatchedAtMemoryLimit(t *testing.T) {
	e, ctx, img := startLFPython(t)
	lf := e.lfClient()
	const perCall = 256
	parent := e.startCounter(t, ctx, img, "patchlimit-"+lfRandom(3), 64, "--writes-per-signal", strconv.Itoa(perCall))
	ctr, err := e.Client().LoadContainer(ctx, parent.id)
	if err != nil {
		t.Fatal(err)
	}
	limitFile := memoryCgroupFile(t, ctx, ctr, "memory.limit_in_bytes", "memory.max")
	if cgroups.Mode() == cgroups.Unified {
		t.Skip("cgroup v2: patches are written by the shim (charged to it), as documented")
	}
	fork := func() error {
		t.Helper()
		res, err := lf.Fork(ctx, parent.id, 1, e.logIO())
		if err == nil {
			checkContinues(t, ctx, parent, e.forks(res)[0])
		}
		return err
	}
	if err := fork(); err != nil { // the parent moves onto its memory file
		t.Fatal(err)
	}
	parent.signal(t, ctx, syscall.SIGUSR2, "wrote ")
	usage := memoryUsage(t, ctx, ctr)
	if err := os.WriteFile(limitFile, []byte(strconv.FormatUint(usage+64<<20, 10)), 0); err != nil {
		t.Fatal(err)
	}
	shmem := shmemOf(t, ctx, ctr)
	from := len(e.Log())
	if err := fork(); err != nil {
		t.Fatalf("patched fork with 64 MiB of room: %v", err)
	}
	if l := grepLines(e.Log()[from:], "checkpoint rewritten"); !strings.Contains(l, "patched=true") {
		t.Fatalf("the second fork was not a patched delta: %s", l)
	}
	grew := int64(shmemOf(t, ctx, ctr)) - int64(shmem)
	t.Logf("patched fork: the parent's cgroup shmem grew by %d kB", grew>>10)
	if grew < perCall*4<<10 {
		t.Errorf("the parent's cgroup shmem grew by %d kB for %d pages written spread: its patches were charged elsewhere", grew>>10, perCall)
	}

	// No room: refused, the parent runs on.
	snapshots := e.snapshotsLeft(t)
	parent.signal(t, ctx, syscall.SIGUSR2, "wrote ")
	usage = memoryUsage(t, ctx, ctr)
	if err := os.WriteFile(limitFile, []byte(strconv.FormatUint(usage+1<<20, 10)), 0); err != nil {
		t.Fatal(err)
	}
	if err := fork(); err == nil || !strings.Contains(err.Error(), "memory limit") {
		t.Fatalf("patched fork at the memory limit: %v, want a clear error naming the limit", err)
	}
	if st, err := parent.task.Status(ctx); err != nil || st.Status != containerd.Running {
		t.Fatalf("parent after the refused snapshot: %v %v", st.Status, err)
	}
	parent.waitLine(t, ctx, len(parent.lines(t)), "tick ")
	if v, want := parent.signal(t, ctx, syscall.SIGUSR1, "verify "), fmt.Sprintf("verify ok pages=%d writes=%d", 64<<20/4096, 2*perCall); v != want {
		t.Errorf("parent after the refused snapshot: %q, want %q", v, want)
	}
	if left := e.snapshotsLeft(t); !slices.Equal(left, snapshots) {
		t.Errorf("snapshots after the refused call: %q, before it: %q", left, snapshots)
	}
}
