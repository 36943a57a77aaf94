package integration

import (
	"context"
	"strings"
	"syscall"
	"testing"

	containerd "github.com/containerd/containerd/v2/client"
	"github.com/containerd/containerd/v2/pkg/namespaces"
	"github.com/containerd/containerd/v2/pkg/oci"

	"github.com/lazyfork/lazyfork/api"
	lfclient "github.com/lazyfork/lazyfork/client"
	"github.com/lazyfork/lazyfork/integration/harness"
	"github.com/lazyfork/lazyfork/memfile"
)

// secretProg holds 8 MiB and, on each SIGUSR2, about 1 MiB of fresh memory
// holding a secret built at run time (so the token appears nowhere else: not
// in argv, not in the program text): "LFSECRET-<tag>-<n>". It prints "ready",
// "tick N" and "secret TOKEN".
func secretProg(tag string) []string {
	prog := `import signal,time
h=bytearray(8<<20)
for i in range(0,len(h),4096): h[i]=1
keep=[]
def tok(n): return ('LF'+'SECRET-')+'` + tag + `-'+str(n)
def on(sig,frm):
    keep.append(bytearray(tok(len(keep)).encode()*(1<<16)))
    print('secret '+tok(len(keep)-1),flush=True)
signal.signal(signal.SIGUSR2,on)
keep.append(bytearray(tok(0).encode()*(1<<16)))
print('ready',flush=True)
n=0
while True:
    n+=1
    print('tick %d'%n,flush=True)
    time.sleep(0.05)
`
	return []string{"python3", "-c", prog}
}

// memScan lists the files in /.lazyfork/mem ("file NAME") and those whose
// data holds argv[1] ("hit NAME"), then prints "done".
const memScan = `import os,sys
tok=sys.argv[1].encode()
d='/.lazyfork/mem'
for f in sorted(os.listdir(d)):
    print('file',f)
    fd=os.open(d+'/'+f,os.O_RDONLY)
    off,hit=0,False
    while not hit:
        try: s=os.lseek(fd,off,os.SEEK_DATA)
        except OSError: break
        e=os.lseek(fd,s,os.SEEK_HOLE)
        prev=b''
        while s<e and not hit:
            b=os.pread(fd,min(1<<20,e-s),s)
            if not b: break
            hit=tok in prev+b
            prev=b[-len(tok):]
            s+=len(b)
        off=e
    os.close(fd)
    if hit: print('hit',f)
print('done')
`

// memHits lists the files under /.lazyfork/mem of a task, and those holding token.
func (e *lfEnv) memHits(t *testing.T, ctx context.Context, task containerd.Task, token string) (files, hits []string) {
	t.Helper()
	// Memory files are sparse (a 1 TiB slot per mapping): read only their
	// data extents (grep would buffer the holes as one line).
	out, code, err := e.execOut(ctx, task, "python3", "-c", memScan, token)
	if err != nil || code != 0 || !strings.Contains(out, "done") {
		t.Fatalf("%s: list /.lazyfork/mem: %q %d %v", task.ID(), out, code, err)
	}
	for _, l := range strings.Split(out, "\n") {
		if f, ok := strings.CutPrefix(l, "file "); ok && strings.HasSuffix(f, memfile.FileExt) {
			files = append(files, f)
		}
		if f, ok := strings.CutPrefix(l, "hit "); ok {
			hits = append(hits, f)
		}
	}
	return files, hits
}

// TestIsolation: no container reaches another's memory (issue 19, points 1-3).
// A victim holds a secret; it has been forked, so memory files holding the
// secret exist. Then:
//  1. a container naming the victim's family (same or another namespace)
//     sees no memory file at /.lazyfork/mem;
//  2. a container naming the victim in lazyfork.io/fork-of from another
//     namespace, by id or by its kept snapshot, is refused and the victim
//     keeps running;
//  3. memory a fork wrote after it diverged is seen by that fork's own forks,
//     never by its sibling or its parent.
func TestIsolation(t *testing.T) {
	// The node API serves the shim's fork-of of a running container, as on
	// a node lazyfork setup made: the attempts below reach its checks.
	na := newNodeAPI(t)
	e := startLF(t, harness.Options{Env: []string{na.Env()}})
	na.start(t, e.Bin, e.Root)
	ctx := e.ctx(t)
	img, err := e.ImportImage(ctx, "python")
	if err != nil {
		t.Fatal(err)
	}
	lf := e.lfClient()
	victimID := "victim-" + lfRandom(3)
	_, victimTask := e.run(t, ctx, img, victimID, secretProg("victim"))
	victim := &counter{e: e, id: victimID, task: victimTask}
	victim.waitLine(t, ctx, 0, "tick 3")
	res, err := lf.Fork(ctx, victimID, 2, e.logIO(), lfclient.KeepSnapshot())
	if err != nil {
		t.Fatal(err)
	}
	defer lf.RemoveSnapshot(context.WithoutCancel(ctx), res.Snapshot)
	forkA, forkB := e.forks(res)[0], e.forks(res)[1]
	forkA.waitLine(t, ctx, 0, "tick ")
	forkB.waitLine(t, ctx, 0, "tick ")
	// Control: the victim's forks map its file, which holds the secret; so
	// a file there is what an attacker would read.
	if files, hits := e.memHits(t, ctx, forkA.task, "LFSECRET-victim-0"); len(hits) == 0 {
		t.Fatalf("control: the victim's fork sees no file holding the victim's secret among %v (the test could not detect a leak)", files)
	}

	otherNS := "other-" + lfRandom(3)
	octx := namespaces.WithNamespace(ctx, otherNS)
	oimg, err := e.ImportImage(octx, "python")
	if err != nil {
		t.Fatal(err)
	}
	// The harness's teardown sweeps every namespace.

	withAnn := func(k, v string) oci.SpecOpts { return oci.WithAnnotations(map[string]string{k: v}) }

	t.Run("family annotation", func(t *testing.T) {
		for _, tc := range []struct {
			name string
			ctx  context.Context
			img  containerd.Image
		}{{"same namespace", ctx, img}, {"other namespace", octx, oimg}} {
			id := "joiner-" + lfRandom(3)
			_, task := e.run(t, tc.ctx, tc.img, id, pyHold(1, ""), withAnn(api.AnnotationFamily, victimID))
			files, hits := e.memHits(t, tc.ctx, task, "LFSECRET-victim")
			if len(files) != 0 || len(hits) != 0 {
				t.Errorf("%s: a container naming the victim's family sees memory files %v (holding the secret: %v)", tc.name, files, hits)
			}
			if _, err := task.Delete(tc.ctx, containerd.WithProcessKill); err != nil {
				t.Error(err)
			}
		}
	})

	t.Run("fork-of from another namespace", func(t *testing.T) {
		for _, ref := range []string{victimID, res.Snapshot} {
			id := "thief-" + lfRandom(3)
			ctr, err := e.NewContainer(octx, id, harness.ContainerConfig{
				Image: oimg, Args: pyHold(1, ""), Runtime: lfRuntime,
				SpecOpts: []oci.SpecOpts{withAnn(api.AnnotationForkOf, ref)},
			})
			if err != nil {
				t.Fatal(err)
			}
			task, err := e.StartTask(octx, ctr)
			if err == nil {
				out, _, _ := e.execOut(octx, task, "sh", "-c", "ls /.lazyfork/mem; cat /proc/1/cmdline")
				t.Errorf("fork-of=%s from namespace %s ran: %q", ref, otherNS, out)
				task.Delete(octx, containerd.WithProcessKill)
			} else if !strings.Contains(err.Error(), "permission denied") && !strings.Contains(err.Error(), "not found") {
				t.Errorf("fork-of=%s from namespace %s: %v, want permission denied or not found", ref, otherNS, err)
			}
			ctr.Delete(octx, containerd.WithSnapshotCleanup)
		}
		if st, err := victim.task.Status(ctx); err != nil || st.Status != containerd.Running {
			t.Fatalf("victim after the attempts: %v %v, want running", st.Status, err)
		}
		victim.waitLine(t, ctx, len(victim.lines(t)), "tick ")
	})

	t.Run("sibling deltas", func(t *testing.T) {
		// Fork A writes a secret into fresh memory, then is forked: the new
		// snapshot's file holds it.
		line := forkA.signal(t, ctx, syscall.SIGUSR2, "secret ")
		token := strings.TrimPrefix(line, "secret ")
		if !strings.Contains(token, "victim-1") {
			t.Fatalf("fork A wrote %q", token)
		}
		resA, err := lf.Fork(ctx, forkA.id, 1, e.logIO())
		if err != nil {
			t.Fatal(err)
		}
		grandchild := e.forks(resA)[0]
		grandchild.waitLine(t, ctx, 0, "tick ")
		if _, hits := e.memHits(t, ctx, grandchild.task, token); len(hits) == 0 {
			t.Fatalf("control: fork A's own fork sees no file holding A's secret %q (did the snapshot move it into a file?)", token)
		}
		for _, c := range []*counter{forkB, victim} {
			files, hits := e.memHits(t, ctx, c.task, token)
			if len(hits) != 0 {
				t.Errorf("%s sees fork A's secret in %v (its memory directory: %v)", c.id, hits, files)
			}
		}
		// B's directory holds exactly its own lineage: the files its
		// snapshot maps.
		snap, err := memfile.ReadSnapshot(res.Snapshot)
		if err != nil {
			t.Fatal(err)
		}
		files, _ := e.memHits(t, ctx, forkB.task, token)
		if strings.Join(files, ",") != strings.Join(snap.Files, ",") {
			t.Errorf("fork B sees %v, want only its snapshot's files %v", files, snap.Files)
		}
	})
}
