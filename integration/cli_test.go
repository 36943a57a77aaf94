package integration

import (
	"bytes"
	"encoding/json"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/lazyfork/lazyfork/integration/harness"
	snapclient "github.com/lazyfork/lazyfork/snapshotter/client"
)

// cliEnv runs the built lazyfork binary against a private containerd that has
// LazyFork's shim and snapshotter.
type cliEnv struct {
	*lfEnv
	logDir string
}

func startCLIEnv(t *testing.T) *cliEnv {
	t.Helper()
	bin := lfBin(t)
	snRoot, snAddr := startSnapshotter(t, bin)
	t.Setenv("LAZYFORK_BIN", bin)
	e := startLF(t, harness.Options{ProxyPlugins: []harness.ProxyPlugin{{
		Name: snapclient.SnapshotterName, Type: "snapshot", Address: snAddr, ExportsRoot: snRoot,
	}}})
	return &cliEnv{lfEnv: e, logDir: t.TempDir()}
}

// lf runs `lazyfork ARGS` against the private stack and returns stdout; a
// non-zero exit is an error carrying stderr.
func (e *cliEnv) lf(t *testing.T, args ...string) (string, error) {
	t.Helper()
	full := append([]string{"--address", e.Address, "--namespace", e.Namespace, "--root", e.Root, "--log-dir", e.logDir}, args...)
	cmd := exec.Command(filepath.Join(e.Bin, "lazyfork"), full...)
	var out, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &stderr
	err := cmd.Run()
	if err != nil {
		return out.String(), errors.New(strings.TrimSpace(stderr.String()) + " (" + err.Error() + ")")
	}
	return out.String(), nil
}

func (e *cliEnv) must(t *testing.T, args ...string) string {
	t.Helper()
	out, err := e.lf(t, args...)
	if err != nil {
		t.Fatalf("lazyfork %s: %v\n%s", strings.Join(args, " "), err, out)
	}
	return out
}

type cliRow struct {
	ID, Name, State, Parent string
	Depth                   int
	PID                     int
	Procs                   int
	MemoryBytes             int64
	MemFile                 bool
	MemFileBytes            int64
}

func (e *cliEnv) list(t *testing.T) map[string]cliRow {
	t.Helper()
	var l struct {
		Containers []cliRow
		Total      struct{ Containers int }
	}
	if err := json.Unmarshal([]byte(e.must(t, "list", "--format", "json")), &l); err != nil {
		t.Fatal(err)
	}
	m := map[string]cliRow{}
	for _, r := range l.Containers {
		m[r.ID] = r
	}
	if l.Total.Containers != len(m) {
		t.Errorf("list total %d, %d rows", l.Total.Containers, len(m))
	}
	return m
}

// waitTick waits until the log of container id (through attach) shows a tick
// greater than after, and returns the last tick seen.
func (e *cliEnv) waitTick(t *testing.T, id string, after int) int {
	t.Helper()
	deadline := time.Now().Add(60 * time.Second)
	for {
		out, err := e.lf(t, "attach", id, "--follow=false")
		last := 0
		for _, l := range strings.Split(out, "\n") {
			if n, ok := strings.CutPrefix(l, "tick "); ok {
				if v, err := strconv.Atoi(strings.TrimSpace(n)); err == nil {
					last = v
				}
			}
		}
		if err == nil && last > after {
			return last
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s: no tick after %d in its output (%v):\n%s", id, after, err, out)
		}
		time.Sleep(100 * time.Millisecond)
	}
}

func firstTick(t *testing.T, out string) int {
	for _, l := range strings.Split(out, "\n") {
		if n, ok := strings.CutPrefix(l, "tick "); ok {
			v, _ := strconv.Atoi(strings.TrimSpace(n))
			return v
		}
	}
	t.Fatalf("no tick in %q", out)
	return 0
}

// TestCLI drives every command of the built binary through containerd, the
// shim and the snapshotter, as the README's example does.
func TestCLI(t *testing.T) {
	e := startCLIEnv(t)
	ctx := e.ctx(t)
	for _, name := range []string{"python", "busybox"} {
		if _, err := e.ImportImage(ctx, name, harness.WithSnapshotter(snapclient.SnapshotterName)); err != nil {
			t.Fatal(err)
		}
	}
	pyRef, _ := harness.ImageRef("python")
	bbRef, _ := harness.ImageRef("busybox")

	// create + attach
	id := strings.TrimSpace(e.must(t, "create", "--name", "counter", pyRef, "--", "python3", counterPy, "16", "--interval", "0.05"))
	if id != "counter" {
		t.Fatalf("create printed %q", id)
	}
	before := e.waitTick(t, "counter", 3)
	if r := e.list(t)["counter"]; r.MemFile || r.MemFileBytes != 0 {
		t.Errorf("counter on memory files before any fork: %+v", r)
	}

	// fork --name: twin continues the count from the parent's tick
	if out := strings.TrimSpace(e.must(t, "fork", "counter", "--name", "twin")); out != "twin" {
		t.Fatalf("fork printed %q", out)
	}
	e.waitTick(t, "twin", 0)
	twinOut, _ := e.lf(t, "attach", "twin", "--follow=false")
	if ft := firstTick(t, twinOut); ft <= before {
		t.Errorf("twin's first tick %d: not after the parent's tick %d before the fork", ft, before)
	}
	t.Logf("parent at tick %d before the fork; twin starts at tick %d", before, firstTick(t, twinOut))

	// fork --count: ids printed one a line; a fork of a fork
	ids := strings.Fields(e.must(t, "fork", "counter", "--count", "2"))
	if len(ids) != 2 {
		t.Fatalf("fork --count 2 printed %q", ids)
	}
	grand := strings.TrimSpace(e.must(t, "fork", "twin"))
	rows := e.list(t)
	for _, x := range append(ids, "twin", grand, "counter") {
		r, ok := rows[x]
		if !ok || r.State != "running" || r.PID == 0 || r.Procs < 1 || r.MemoryBytes <= 0 {
			t.Errorf("list row of %s: %+v", x, r)
		}
	}
	if r := rows["twin"]; r.Parent != "counter" || r.Depth != 1 || r.Name != "twin" {
		t.Errorf("twin in list: %+v", r)
	}
	if r := rows[grand]; r.Parent != "twin" || r.Depth != 2 {
		t.Errorf("grandchild in list: %+v", r)
	}
	// The forks run on memory files, and so does the parent once it has
	// been forked (it moved onto its snapshot's memory file).
	for _, x := range append(ids, "twin", grand, "counter") {
		if r := rows[x]; !r.MemFile || r.MemFileBytes < 16<<20 {
			t.Errorf("list: %s does not show its 16 MiB heap on memory files: %+v", x, r)
		}
	}
	for x, r := range rows {
		t.Logf("list: %s state=%s depth=%d memory=%d memfile=%v (%d bytes)", x, r.State, r.Depth, r.MemoryBytes, r.MemFile, r.MemFileBytes)
	}
	table := e.must(t, "list")
	if !strings.Contains(table, "TOTAL") || !strings.Contains(table, "twin") || !strings.Contains(table, "MEMFILE") {
		t.Errorf("list table:\n%s", table)
	}
	tree := e.must(t, "tree")
	if !strings.Contains(tree, "counter") || !strings.Contains(tree, "── twin") || !strings.Contains(tree, "── "+grand) {
		t.Errorf("tree:\n%s", tree)
	}
	var treeJSON []map[string]any
	if err := json.Unmarshal([]byte(e.must(t, "tree", "--format", "json")), &treeJSON); err != nil || len(treeJSON) != 1 {
		t.Errorf("tree json: %v %v", treeJSON, err)
	}

	// exec: stdout, exit status
	if out := e.must(t, "exec", "twin", "--", "echo", "hello-from-twin"); strings.TrimSpace(out) != "hello-from-twin" {
		t.Errorf("exec printed %q", out)
	}
	if _, err := e.lf(t, "exec", "twin", "--", "sh", "-c", "exit 3"); err == nil || !strings.Contains(err.Error(), "exit status 3") {
		t.Errorf("exec exit 3: %v", err)
	}

	// shell without a terminal reads commands from stdin
	sh := exec.Command(filepath.Join(e.Bin, "lazyfork"), "--address", e.Address, "--namespace", e.Namespace, "--root", e.Root, "shell", "twin")
	sh.Stdin = strings.NewReader("echo shell-$((40+2))\nexit\n")
	if out, err := sh.Output(); err != nil || strings.TrimSpace(string(out)) != "shell-42" {
		t.Errorf("shell: %q %v", out, err)
	}

	// attach follows new output until interrupted (Ctrl-C), then returns 0
	at := exec.Command(filepath.Join(e.Bin, "lazyfork"), "--address", e.Address, "--namespace", e.Namespace, "--root", e.Root, "attach", "twin")
	var atOut bytes.Buffer
	at.Stdout = &atOut
	if err := at.Start(); err != nil {
		t.Fatal(err)
	}
	seen := e.waitTick(t, "twin", 0)
	e.waitTick(t, "twin", seen) // new output while attached
	time.Sleep(300 * time.Millisecond)
	_ = at.Process.Signal(os.Interrupt)
	if err := at.Wait(); err != nil {
		t.Errorf("attach after Ctrl-C: %v", err)
	}
	if !strings.Contains(atOut.String(), "tick "+strconv.Itoa(seen+1)+"\n") {
		t.Errorf("attach did not stream tick %d", seen+1)
	}
	if r := e.list(t)["twin"]; r.State != "running" {
		t.Errorf("twin after detaching: %s", r.State)
	}

	// freeze / thaw
	e.must(t, "freeze", "twin")
	if r := e.list(t)["twin"]; r.State != "paused" {
		t.Errorf("after freeze twin is %s", r.State)
	}
	e.must(t, "thaw", "twin")
	if r := e.list(t)["twin"]; r.State != "running" {
		t.Errorf("after thaw twin is %s", r.State)
	}

	// stats
	var st struct {
		MemoryBytes, RssAnonBytes int64
		RestoreSeconds            float64
	}
	if err := json.Unmarshal([]byte(e.must(t, "stats", "twin", "--format", "json")), &st); err != nil {
		t.Fatal(err)
	}
	if st.MemoryBytes <= 0 || st.RestoreSeconds <= 0 {
		t.Errorf("stats twin: %+v", st)
	}
	t.Logf("stats twin: %+v", st)
	csvOut := e.must(t, "stats", "twin", "--csv", "--header")
	if lines := strings.Split(strings.TrimSpace(csvOut), "\n"); len(lines) != 2 || !strings.HasPrefix(lines[1], "twin,twin,running,") {
		t.Errorf("stats --csv:\n%s", csvOut)
	}

	// status
	var status struct {
		Containers, Running, MemoryFiles int
		Snapshotter, CRIU, Containerd    string
		FamilyMemoryBytes                int64
	}
	if err := json.Unmarshal([]byte(e.must(t, "status", "--format", "json")), &status); err != nil {
		t.Fatal(err)
	}
	if status.Containers != 5 || status.Running != 5 || status.MemoryFiles < 1 || !strings.HasPrefix(status.Snapshotter, "lazyfork") ||
		!strings.Contains(status.CRIU, "4.") || status.FamilyMemoryBytes <= 0 {
		t.Errorf("status: %+v", status)
	}
	t.Logf("status: %+v", status)

	// errors: unknown name, ambiguous prefix, unforkable container
	if _, err := e.lf(t, "fork", "nosuch"); err == nil || !strings.Contains(err.Error(), `no container named "nosuch"`) {
		t.Errorf("fork of an unknown name: %v", err)
	}
	prefix := ids[0][:strings.LastIndex(ids[0], "-")+1] // <family>-: every fork
	if _, err := e.lf(t, "stats", prefix); err == nil || !strings.Contains(err.Error(), "ambiguous") {
		t.Errorf("ambiguous prefix %q: %v", prefix, err)
	}
	if out := strings.TrimSpace(e.must(t, "freeze", ids[0][:len(ids[0])-2])); out != ids[0] {
		t.Errorf("unique prefix resolved to %q, want %s", out, ids[0])
	}
	e.must(t, "thaw", ids[0])
	e.must(t, "create", "--name", "done", bbRef, "--", "true")
	deadline := time.Now().Add(30 * time.Second)
	for e.list(t)["done"].State != "exited" && time.Now().Before(deadline) {
		time.Sleep(100 * time.Millisecond)
	}
	if _, err := e.lf(t, "fork", "done"); err == nil || !strings.Contains(err.Error(), "cannot be forked") {
		t.Errorf("fork of an exited container without snapshot: %v", err)
	}

	// stop: no process left, still forkable from its snapshot
	e.must(t, "stop", "counter")
	if r := e.list(t)["counter"]; r.State != "stopped" || r.PID != 0 || r.MemoryBytes != 0 {
		t.Errorf("stopped counter: %+v", r)
	}
	stoppedAt := e.waitTick(t, "counter", 0)
	if out := strings.TrimSpace(e.must(t, "fork", "counter", "--name", "again")); out != "again" {
		t.Fatalf("fork of a stopped container printed %q", out)
	}
	e.waitTick(t, "again", 0)
	againOut, _ := e.lf(t, "attach", "again", "--follow=false")
	if ft := firstTick(t, againOut); ft < stoppedAt-1 || ft > stoppedAt+2 {
		t.Errorf("fork of the stopped counter starts at tick %d; it stopped at %d", ft, stoppedAt)
	}

	// delete: children keep running; clean removes what has stopped
	e.must(t, "delete", "-f", "twin")
	if r, ok := e.list(t)[grand]; !ok || r.State != "running" {
		t.Errorf("twin's child after delete twin: %+v", r)
	}
	e.waitTick(t, grand, e.waitTick(t, grand, 0))
	cleaned := strings.Fields(e.must(t, "clean"))
	if strings.Join(cleaned, " ") != "counter done" && strings.Join(cleaned, " ") != "done counter" {
		t.Errorf("clean deleted %q, want counter and done", cleaned)
	}
	left := e.list(t)
	if len(left) != 4 {
		t.Errorf("after clean: %v", left)
	}
	for x := range left {
		e.must(t, "delete", "-f", x)
	}
	if left := e.list(t); len(left) != 0 {
		t.Errorf("after deleting all: %v", left)
	}
	if snaps := e.snapshotsLeft(t); len(snaps) != 0 {
		t.Errorf("snapshots left: %v", snaps)
	}
}
