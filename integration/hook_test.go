package integration

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"

	containerd "github.com/containerd/containerd/v2/client"
	"github.com/containerd/containerd/v2/pkg/oci"
	specs "github.com/opencontainers/runtime-spec/specs-go"

	"github.com/lazyfork/lazyfork/api"
	"github.com/lazyfork/lazyfork/hook"
	"github.com/lazyfork/lazyfork/integration/harness"
)

// buildStatic builds the command in the repository's package pkg (e.g.
// "./examples/agent") as a static binary, for a busybox container.
func buildStatic(t *testing.T, pkg string) string {
	t.Helper()
	repo, err := harness.RepoRoot()
	if err != nil {
		t.Fatal(err)
	}
	out := filepath.Join(t.TempDir(), filepath.Base(pkg))
	cmd := exec.Command("go", "build", "-o", out, pkg)
	cmd.Dir = repo
	cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
	if b, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("build %s: %v\n%s", pkg, err, b)
	}
	return out
}

// countLines counts lines of a task log matching re.
func countLines(t *testing.T, path string, re *regexp.Regexp) int {
	t.Helper()
	lines, err := harness.ReadLines(path)
	if err != nil {
		t.Fatal(err)
	}
	n := 0
	for _, l := range lines {
		if re.MatchString(l) {
			n++
		}
	}
	return n
}

// TestHook: a container with a hook hears QUIESCE before every snapshot of it
// (forks, forks of forks, stop) and every restored copy hears RESEED with its
// own id, then draws its own random numbers.
func TestHook(t *testing.T) {
	e := startLF(t, harness.Options{})
	ctx := e.ctx(t)
	agent := buildStatic(t, "./examples/agent")
	img, err := e.ImportImage(ctx, "busybox")
	if err != nil {
		t.Fatal(err)
	}
	hookDir, err := os.MkdirTemp("", "lfhook-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(hookDir) })
	id := "hk-" + lfRandom(4)
	if err := os.MkdirAll(filepath.Join(hookDir, id), 0o755); err != nil {
		t.Fatal(err)
	}
	ctr, err := e.NewContainer(ctx, id, harness.ContainerConfig{
		Image: img, Runtime: lfRuntime, Args: []string{"/agent", "--interval", "50ms"},
		SpecOpts: []oci.SpecOpts{
			oci.WithMounts([]specs.Mount{
				{Destination: "/agent", Type: "bind", Source: agent, Options: []string{"rbind", "ro"}},
				{Destination: hook.ContainerDir, Type: "bind", Source: filepath.Join(hookDir, id), Options: []string{"rbind", "rw"}},
			}),
			oci.WithEnv([]string{hook.EnvSocket + "=" + hook.ContainerDir + "/" + hook.SocketName, "HOSTNAME=" + id}),
		},
		ContainerOpts: []containerd.NewContainerOpts{containerd.WithAdditionalContainerLabels(map[string]string{api.LabelHook: hookDir})},
	})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := e.StartTask(ctx, ctr); err != nil {
		t.Fatal(err)
	}
	tickRe := regexp.MustCompile(`^tick \d+ id=`)
	waitFor := func(cid string, re *regexp.Regexp) {
		t.Helper()
		wctx, cancel := context.WithTimeout(ctx, 60*time.Second)
		defer cancel()
		if _, err := harness.WaitLine(wctx, e.TaskLogPath(cid), 0, re.MatchString); err != nil {
			b, _ := os.ReadFile(e.TaskLogPath(cid))
			t.Fatalf("%s: no line %v: %v\n%s", cid, re, err, b)
		}
	}
	waitFor(id, tickRe)
	quiesce := regexp.MustCompile(`^quiesce$`)
	lf := e.lfClient()

	res, err := lf.Fork(ctx, id, 2, e.logIO())
	if err != nil {
		t.Fatal(err)
	}
	if n := countLines(t, e.TaskLogPath(id), quiesce); n != 1 {
		t.Errorf("parent heard QUIESCE %d times for one snapshot", n)
	}
	// The running parent moved onto its memory file, and the move's plan
	// gave the dump the Go runtime's MADV_WIPEONFORK pages (its vDSO
	// getrandom state): the rewrite dropped them with no second read of
	// the frozen tree's smaps.
	wiped := false
	for _, l := range strings.Split(e.Log(), "\n") {
		if strings.Contains(l, "checkpoint rewritten") && strings.Contains(l, "id="+id+" ") {
			wiped = strings.Contains(l, "wipe_from_move=true") && !strings.Contains(l, "pages_wiped=0 ")
			if !wiped {
				t.Errorf("the parent's snapshot took no wipe-on-fork pages from its move: %s", l)
			}
		}
	}
	if !wiped && !t.Failed() {
		t.Errorf("no \"checkpoint rewritten\" line for %s in the containerd log", id)
	}
	rands := map[string]string{}
	for _, f := range res.Forks {
		fid := f.Container.ID()
		// RESEED came back OK before Fork returned: the line is in the log.
		if n := countLines(t, e.TaskLogPath(fid), regexp.MustCompile(`^reseed id=`+regexp.QuoteMeta(fid)+` seed=\d+$`)); n != 1 {
			b, _ := os.ReadFile(e.TaskLogPath(fid))
			t.Errorf("fork %s heard RESEED with its id %d times:\n%s", fid, n, b)
		}
		own := regexp.MustCompile(`^tick \d+ id=` + regexp.QuoteMeta(fid) + ` rand=`)
		waitFor(fid, own)
		l, _ := harness.WaitLine(ctx, e.TaskLogPath(fid), 0, own.MatchString)
		rands[fid] = l[strings.Index(l, "rand="):]
		if _, err := os.Stat(hook.HostSocket(hookDir, fid)); err != nil {
			t.Errorf("fork %s has no hook socket of its own: %v", fid, err)
		}
	}
	if len(rands) == 2 && rands[res.Forks[0].Container.ID()] == rands[res.Forks[1].Container.ID()] {
		t.Errorf("two reseeded forks drew the same number: %v", rands)
	}

	// A fork of a fork: the fork quiesces, the grandchild reseeds.
	child := res.Forks[0].Container.ID()
	gres, err := lf.Fork(ctx, child, 1, e.logIO())
	if err != nil {
		t.Fatal(err)
	}
	if n := countLines(t, e.TaskLogPath(child), quiesce); n != 1 {
		t.Errorf("fork %s heard QUIESCE %d times for one snapshot", child, n)
	}
	gid := gres.Forks[0].Container.ID()
	if n := countLines(t, e.TaskLogPath(gid), regexp.MustCompile(`^reseed id=`+regexp.QuoteMeta(gid)+` `)); n != 1 {
		t.Errorf("grandchild %s heard RESEED with its id %d times", gid, n)
	}

	// Stop snapshots (QUIESCE again); a fork of the stopped parent reseeds.
	if _, err := lf.Stop(ctx, id); err != nil {
		t.Fatal(err)
	}
	if n := countLines(t, e.TaskLogPath(id), quiesce); n != 2 {
		t.Errorf("parent heard QUIESCE %d times for two snapshots", n)
	}
	sres, err := lf.Fork(ctx, id, 1, e.logIO())
	if err != nil {
		t.Fatal(err)
	}
	sid := sres.Forks[0].Container.ID()
	if n := countLines(t, e.TaskLogPath(sid), regexp.MustCompile(`^reseed id=`+regexp.QuoteMeta(sid)+` `)); n != 1 {
		t.Errorf("fork %s of the stopped parent heard RESEED with its id %d times", sid, n)
	}
	// The stopped parent did nothing past its snapshot: the fork's first
	// tick follows the parent's last one.
	waitFor(sid, regexp.MustCompile(`^tick \d+ id=`))
	lastParent, firstFork := tickNumbers(t, e.TaskLogPath(id)), tickNumbers(t, e.TaskLogPath(sid))
	if len(lastParent) == 0 || len(firstFork) == 0 || firstFork[0] != lastParent[len(lastParent)-1]+1 {
		t.Errorf("after stop: the parent's ticks end at %v, the fork's start at %v; want the fork to go on from the parent's last", lastParent[max(len(lastParent)-3, 0):], firstFork[:min(len(firstFork), 1)])
	}
	if err := lf.Delete(ctx, id); err != nil {
		t.Fatal(err)
	}
}

// tickNumbers lists the N of the "tick N id=..." lines of a task log.
func tickNumbers(t *testing.T, path string) []int {
	t.Helper()
	lines, err := harness.ReadLines(path)
	if err != nil {
		t.Fatal(err)
	}
	var out []int
	for _, l := range lines {
		var n int
		if _, err := fmt.Sscanf(l, "tick %d ", &n); err == nil {
			out = append(out, n)
		}
	}
	return out
}
