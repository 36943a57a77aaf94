package integration

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"slices"
	"syscall"
	"testing"
	"time"

	containerd "github.com/containerd/containerd/v2/client"

	"github.com/lazyfork/lazyfork/api"
	lfclient "github.com/lazyfork/lazyfork/client"
)

// TestShimJoin: forks that join a shim group's running shim (no shim start
// of their own, client/shimjoin.go) behave as any fork. A second call
// restoring the same snapshot joins the shim the first call's forks run in
// and starts no shim; they all survive a containerd restart (containerd
// reloads them from their bundles) and answer signals after it; a call
// whose group's shim went between its lookup and its task create starts the
// shim the usual way; the last fork's delete ends the group's shim; no
// sandbox record is ever left.
func TestShimJoin(t *testing.T) {
	e, ctx, img := startLFPython(t)
	parent := e.startCounter(t, ctx, img, "par-"+lfRandom(4), 64)
	lf := lfclient.New(e.Client(), lfclient.WithRoot(e.Root))

	res, err := lf.Fork(ctx, parent.id, 3, lfclient.KeepSnapshot(), e.logIO())
	if err != nil {
		t.Fatal(err)
	}
	defer lf.RemoveSnapshot(context.WithoutCancel(ctx), res.Snapshot)
	checkShimJoins(t, ctx, e, res.Forks, lfclient.DefaultShimGroupSize)
	first := e.forks(res)
	shimsBefore := shimsByID(e.Address)

	// A second call of the same snapshot: its fork joins the running shim.
	more, err := lf.RestoreForks(ctx, parent.id, res.Snapshot, 2, e.logIO())
	if err != nil {
		t.Fatal(err)
	}
	firstIDs := counterIDs(first)
	for _, f := range more {
		sb := e.bundleFile(t, f.Container.ID(), "sandbox")
		if !slices.Contains(firstIDs, sb) {
			t.Errorf("fork %s of the second call names sandbox %q, want one of the first call's forks %v", f.Container.ID(), sb, firstIDs)
		}
		e.noSandboxRecord(t, ctx, sb)
	}
	if shims := shimsByID(e.Address); len(shims) != len(shimsBefore) {
		t.Errorf("the second call started shims: %d before, %d after (%v)", len(shimsBefore), len(shims), shims)
	}
	all := append(first, e.forks(&lfclient.Result{Forks: more})...)
	for _, f := range all[len(first):] {
		checkContinues(t, ctx, parent, f)
	}

	// containerd restarted: it reloads the joined tasks from their bundles.
	if err := e.KillDaemon(); err != nil {
		t.Fatal(err)
	}
	if err := e.StartDaemon(context.Background()); err != nil {
		t.Fatal(err)
	}
	lf = lfclient.New(e.Client(), lfclient.WithRoot(e.Root)) // the harness's new client
	for _, f := range append(all, parent) {
		ctr, err := e.Client().LoadContainer(ctx, f.id)
		if err != nil {
			t.Fatal(err)
		}
		if f.task, err = ctr.Task(ctx, nil); err != nil {
			t.Fatalf("%s after containerd's restart: %v", f.id, err)
		}
	}
	for _, f := range all {
		if st, err := f.task.Status(ctx); err != nil || st.Status != containerd.Running {
			t.Errorf("%s after containerd's restart: %v %v", f.id, st.Status, err)
		}
		if v := f.signal(t, ctx, syscall.SIGUSR1, "verify "); v != "verify ok pages=16384 writes=0" {
			t.Errorf("%s after containerd's restart: %q", f.id, v)
		}
	}

	// The group's shim goes between the call's lookup and its task create:
	// the fork starts its shim the usual way.
	var removed, joining bool
	gone := lfclient.WithStepTrace(func(id string, s lfclient.ForkStep, _ time.Time) {
		if s != lfclient.StepQueued || removed {
			return
		}
		removed = true
		// The call found the group's shim and recorded the join.
		sbs, err := e.Client().SandboxStore().List(ctx)
		if err != nil {
			t.Error(err)
		}
		for _, sb := range sbs {
			joining = joining || slices.Contains(counterIDs(all), sb.Labels[api.LabelShimGroupLeader])
		}
		for _, f := range all {
			if err := lf.Delete(ctx, f.id); err != nil {
				t.Errorf("delete %s: %v", f.id, err)
			}
		}
	})
	late, err := lf.RestoreForks(ctx, parent.id, res.Snapshot, 1, e.logIO(), gone)
	if err != nil {
		t.Fatalf("restore after the group's shim went: %v", err)
	}
	if !joining {
		t.Error("the call did not look to join the group's running shim")
	}
	lateFork := e.forks(&lfclient.Result{Forks: late})[0]
	if sb := e.bundleFile(t, lateFork.id, "sandbox"); sb != "" {
		t.Errorf("fork %s names sandbox %q after its leader went, want none (the usual path)", lateFork.id, sb)
	}
	e.noSandboxRecord(t, ctx, "")
	checkContinues(t, ctx, parent, lateFork)
	if _, ok := shimsByID(e.Address)[lateFork.id]; !ok {
		t.Errorf("no shim started by %s: %v", lateFork.id, shimsByID(e.Address))
	}
	if err := lf.Delete(ctx, lateFork.id); err != nil {
		t.Fatal(err)
	}
	// Every fork is gone: so are their shims, the joined forks' included.
	deadline := time.Now().Add(30 * time.Second)
	for {
		shims := shimsByID(e.Address)
		delete(shims, parent.id)
		if len(shims) == 0 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("shims left after every fork was deleted: %v", shims)
		}
		time.Sleep(100 * time.Millisecond)
	}
	e.assertNothingLeft(t, ctx, parent.id, res.Family, append(counterIDs(all), lateFork.id))
}

// bundleFile is a file of a task's bundle, "" if it has none.
func (e *lfEnv) bundleFile(t *testing.T, id, name string) string {
	t.Helper()
	b, err := os.ReadFile(filepath.Join(e.State, "io.containerd.runtime.v2.task", e.Namespace, id, name))
	if err != nil && !errors.Is(err, os.ErrNotExist) {
		t.Fatal(err)
	}
	return string(b)
}

// noSandboxRecord checks that containerd holds no sandbox record of
// LazyFork's (id, or any when id is "").
func (e *lfEnv) noSandboxRecord(t *testing.T, ctx context.Context, id string) {
	t.Helper()
	sbs, err := e.Client().SandboxStore().List(ctx)
	if err != nil {
		t.Fatal(err)
	}
	for _, sb := range sbs {
		if (id == "" || sb.ID == id) && sb.Labels[api.LabelShimGroupLeader] != "" {
			t.Errorf("sandbox record %s left after the call", sb.ID)
		}
	}
}

func counterIDs(cs []*counter) []string {
	var ids []string
	for _, c := range cs {
		ids = append(ids, c.id)
	}
	return ids
}

// TestForkCallsShareFamilyShims: successive calls forking a running parent
// (a new snapshot each) fill the family's shims up to the group size, as
// agents forking one at a time do, instead of starting a shim per call. The
// second call's fork joins the first's shim (no shim start); the third finds
// it full and starts one; a fork of a fork joins a shim of the family but
// never its own parent's. Killing the first shim takes its two forks only,
// and a later call passes their group by.
func TestForkCallsShareFamilyShims(t *testing.T) {
	e, ctx, img := startLFPython(t)
	parent := e.startCounter(t, ctx, img, "par-"+lfRandom(4), 64)
	lf := lfclient.New(e.Client(), lfclient.WithRoot(e.Root), lfclient.WithShimGroupSize(2))
	var family string
	forkOne := func(p *counter, opts ...lfclient.ForkOpt) (*counter, string) {
		t.Helper()
		res, err := lf.Fork(ctx, p.id, 1, append(opts, e.logIO())...)
		if err != nil {
			t.Fatal(err)
		}
		family = res.Family
		f := e.forks(res)[0]
		checkContinues(t, ctx, p, f)
		e.noSandboxRecord(t, ctx, "")
		info, err := res.Forks[0].Container.Info(ctx)
		if err != nil {
			t.Fatal(err)
		}
		return f, info.Labels[api.LabelShimGroup]
	}
	sandbox := func(f *counter) string { return e.bundleFile(t, f.id, "sandbox") }

	a, groupA := forkOne(parent)
	if _, ok := shimsByID(e.Address)[a.id]; !ok || sandbox(a) != "" {
		t.Fatalf("the family's first fork %s: sandbox %q, shims %v, want a shim started for it", a.id, sandbox(a), shimsByID(e.Address))
	}
	shims := len(shimsByID(e.Address))
	b, groupB := forkOne(parent)
	if sandbox(b) != a.id || groupB != groupA {
		t.Errorf("the second call's fork %s: sandbox %q, group %q; want it to join %s's shim (group %q)", b.id, sandbox(b), groupB, a.id, groupA)
	}
	if n := len(shimsByID(e.Address)); n != shims {
		t.Errorf("the second call started a shim: %d before, %d after", shims, n)
	}
	c, groupC := forkOne(parent)
	if _, ok := shimsByID(e.Address)[c.id]; !ok || sandbox(c) != "" || groupC == groupA {
		t.Errorf("the third call's fork %s (group %q, sandbox %q): want a shim of its own, %q holding two already", c.id, groupC, sandbox(c), groupA)
	}
	// A fork of b: never into b's shim, into c's, which has room.
	d, groupD := forkOne(b)
	if sandbox(d) != c.id || groupD != groupC {
		t.Errorf("fork %s of fork %s: sandbox %q, group %q; want %s's shim (group %q), not its parent's (%q)", d.id, b.id, sandbox(d), groupD, c.id, groupC, groupB)
	}

	// The first shim dies: a and b with it, c, d and the parent run on.
	if err := syscall.Kill(shimsByID(e.Address)[a.id], syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	for _, f := range []*counter{a, b} {
		deadline := time.Now().Add(30 * time.Second)
		for {
			st, err := f.task.Status(ctx)
			if err != nil || st.Status != containerd.Running {
				break
			}
			if time.Now().After(deadline) {
				t.Fatalf("%s still runs after its shim was killed", f.id)
			}
			time.Sleep(50 * time.Millisecond)
		}
	}
	for _, f := range []*counter{c, d, parent} {
		f.waitLine(t, ctx, len(f.lines(t)), "tick ")
	}
	// a and b's group, the fullest, has no live fork left: a call in groups
	// of three passes it by for c's.
	if err := lf.Delete(ctx, d.id); err != nil {
		t.Fatal(err)
	}
	f, groupF := forkOne(parent, lfclient.WithShimGroup(3))
	if sandbox(f) != c.id || groupF != groupC {
		t.Errorf("fork %s after %s's shim died: sandbox %q, group %q; want %s's shim (group %q)", f.id, a.id, sandbox(f), groupF, c.id, groupC)
	}
	ids := counterIDs([]*counter{a, b, c, f})
	for _, id := range ids {
		if err := lf.Delete(ctx, id); err != nil {
			t.Errorf("delete %s: %v", id, err)
		}
	}
	e.assertNothingLeft(t, ctx, parent.id, family, append(ids, d.id))
}
