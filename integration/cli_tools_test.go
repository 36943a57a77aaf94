package integration

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/lazyfork/lazyfork/integration/harness"
	"github.com/lazyfork/lazyfork/internal/testutil"
	snapclient "github.com/lazyfork/lazyfork/snapshotter/client"
)

// The CLI beside the standard tools (issue 15): ctr's and nerdctl's runc
// containers are not lazyfork's to touch, delete refuses a running container
// as ctr does, and exec passes stdin's end to the process.

// startCLITools is startCLIEnv with busybox imported for both snapshotters
// (lazyfork's for lazyfork create, overlayfs for ctr and nerdctl).
func startCLITools(t *testing.T) (*cliEnv, context.Context) {
	t.Helper()
	e := startCLIEnv(t)
	ctx := e.ctx(t)
	for _, sn := range []string{snapclient.SnapshotterName, "overlayfs"} {
		if _, err := e.ImportImage(ctx, "busybox", harness.WithSnapshotter(sn)); err != nil {
			t.Fatal(err)
		}
	}
	return e, ctx
}

// TestCLISafeByDefault: clean, list and delete leave other runtimes' containers
// alone; delete refuses a running container unless -f; exec ends when its
// stdin does.
func TestCLISafeByDefault(t *testing.T) {
	testutil.RequiresBinary(t, "nerdctl")
	testutil.RequiresBinary(t, "ctr")
	e, _ := startCLITools(t)
	bb := harness.BusyboxImage

	// Stopped containers of runc, made by ctr and by nerdctl.
	e.ctr(t, "containers", "create", "--runtime", "io.containerd.runc.v2", bb, "ctr-runc", "true")
	e.mustNerdctl(t, "create", "--name", "nd-runc", "--net", "none", bb, "true")
	ndID := e.nerdctlID(t, "nd-runc")
	// A LazyFork container whose process ended, and a running one.
	e.must(t, "create", "--name", "done", bb, "--", "true")
	e.must(t, "create", "--name", "sleeper", bb, "--", "sleep", "100000")
	deadline := time.Now().Add(60 * time.Second)
	for e.list(t)["done"].State != "exited" {
		if time.Now().After(deadline) {
			t.Fatalf("done never exited: %+v", e.list(t)["done"])
		}
		time.Sleep(100 * time.Millisecond)
	}

	// list shows LazyFork's containers only, unless --all-runtimes.
	rows := e.list(t)
	if _, ok := rows["ctr-runc"]; ok {
		t.Errorf("list shows ctr's runc container: %v", rows)
	}
	if _, ok := rows[ndID]; ok {
		t.Errorf("list shows nerdctl's runc container: %v", rows)
	}
	if all, err := e.lf(t, "list", "--all-runtimes"); err != nil || !strings.Contains(all, "ctr-runc") || !strings.Contains(all, ndID) || !strings.Contains(all, "io.containerd.runc.v2") {
		t.Errorf("list --all-runtimes lacks the runc containers (%v):\n%s", err, all)
	}

	// Shell completion of NAME (as bash runs it: lazyfork __complete WORDS)
	// offers LazyFork's containers by name, not the runc ones unless
	// --all-runtimes.
	complete := func(args ...string) string {
		full := append([]string{"__complete", "--address", e.Address, "--namespace", e.Namespace}, args...)
		out, err := exec.Command(filepath.Join(e.Bin, "lazyfork"), full...).Output()
		if err != nil {
			t.Fatalf("lazyfork %q: %v", full, err)
		}
		return string(out)
	}
	if c := complete("fork", ""); !strings.Contains(c, "sleeper\t") || strings.Contains(c, "ctr-runc") {
		t.Errorf("lazyfork fork <TAB> offers:\n%s", c)
	}
	if c := complete("--all-runtimes", "delete", "sleeper", ""); !strings.Contains(c, "ctr-runc\t") || strings.Contains(c, "sleeper") {
		t.Errorf("lazyfork --all-runtimes delete sleeper <TAB> offers:\n%s", c)
	}

	// clean removes the stopped LazyFork container and nothing else.
	if out := strings.Fields(e.must(t, "clean")); strings.Join(out, " ") != "done" {
		t.Errorf("clean deleted %q, want only done", out)
	}
	if ls := e.ctr(t, "containers", "ls", "-q"); !strings.Contains(ls, "ctr-runc") || !strings.Contains(ls, ndID) {
		t.Errorf("after lazyfork clean, ctr lists:\n%s", ls)
	}
	// nerdctl's own bookkeeping still agrees: it removes its container and
	// the name is free again.
	if out, err := e.nerdctl(t, "rm", "nd-runc"); err != nil {
		t.Errorf("nerdctl rm after lazyfork clean: %v\n%s", err, out)
	}
	if out, err := e.nerdctl(t, "create", "--name", "nd-runc", "--net", "none", bb, "true"); err != nil {
		t.Errorf("nerdctl create of the same name again: %v\n%s", err, out)
	} else {
		e.mustNerdctl(t, "rm", "nd-runc")
	}

	// delete and the other commands refuse another runtime's container by
	// name; --all-runtimes lets them.
	for _, args := range [][]string{{"delete", "ctr-runc"}, {"stats", "ctr-runc"}, {"stop", "ctr-runc"}} {
		if _, err := e.lf(t, args...); err == nil || !strings.Contains(err.Error(), "not LazyFork's") || !strings.Contains(err.Error(), "--all-runtimes") {
			t.Errorf("lazyfork %s: %v", strings.Join(args, " "), err)
		}
	}
	if _, err := e.lf(t, "--all-runtimes", "delete", "ctr-runc"); err != nil {
		t.Errorf("delete --all-runtimes: %v", err)
	}
	if ls := e.ctr(t, "containers", "ls", "-q"); strings.Contains(ls, "ctr-runc") {
		t.Errorf("delete --all-runtimes left ctr-runc")
	}

	// exec: stdin's end reaches the process (cat ends). The input ends
	// after cat has echoed it, so cat is surely running when it does (a
	// pipe closed earlier can beat the shim's own hold on the fifo).
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	cat := exec.CommandContext(ctx, filepath.Join(e.Bin, "lazyfork"), "--address", e.Address, "--namespace", e.Namespace,
		"--root", e.Root, "--log-dir", e.logDir, "exec", "sleeper", "--", "cat")
	in, err := cat.StdinPipe()
	if err != nil {
		t.Fatal(err)
	}
	outPipe, err := cat.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cat.Start(); err != nil {
		t.Fatal(err)
	}
	io.WriteString(in, "hello\n")
	line, err := bufio.NewReader(outPipe).ReadString('\n')
	if line != "hello\n" {
		t.Errorf("lazyfork exec sleeper -- cat echoed %q (%v)", line, err)
	}
	in.Close()
	err = cat.Wait()
	if ctx.Err() != nil {
		t.Errorf("lazyfork exec sleeper -- cat did not end when its stdin did: the EOF never reached cat")
	} else if err != nil {
		t.Errorf("lazyfork exec sleeper -- cat: %v", err)
	}

	// delete refuses a running container, as ctr does; -f kills it.
	if _, err := e.lf(t, "delete", "sleeper"); err == nil || !strings.Contains(err.Error(), "cannot delete sleeper: it is running") {
		t.Errorf("delete of a running container: %v", err)
	}
	if r := e.list(t)["sleeper"]; r.State != "running" {
		t.Errorf("sleeper after a refused delete: %+v", r)
	}
	if out, err := e.lf(t, "delete", "-f", "sleeper"); err != nil || strings.TrimSpace(out) != "sleeper" {
		t.Errorf("delete -f: %q, %v", out, err)
	}
	if left := e.list(t); len(left) != 0 {
		t.Errorf("after delete -f: %v", left)
	}
}

// TestCLIFormats: every listing takes --format table, json or a Go template
// (as nerdctl and docker); list -q prints ids; mem prints human sizes and
// leaves out families whose files are gone.
func TestCLIFormats(t *testing.T) {
	e := startCLIEnv(t)
	ctx := e.ctx(t)
	if _, err := e.ImportImage(ctx, "python", harness.WithSnapshotter(snapclient.SnapshotterName)); err != nil {
		t.Fatal(err)
	}
	e.must(t, "create", "--name", "counter", harness.PythonImage, "--", "python3", counterPy, "16", "--interval", "0.05")
	e.waitTick(t, "counter", 2)
	// Not forked yet: its family has a memory directory but no file.
	if out, err := e.lf(t, "mem"); err != nil || strings.Contains(out, "counter") {
		t.Errorf("mem shows a family without memory files: %v\n%s", err, out)
	}
	fork := strings.TrimSpace(e.must(t, "fork", "counter"))

	lines := func(s string) []string { return strings.Fields(strings.TrimSpace(s)) }
	want := []string{"counter", fork}
	for _, args := range [][]string{{"list", "-q"}, {"list", "--quiet"}, {"list", "--format", "{{.ID}}"}, {"tree", "--format", "{{.ID}}"}} {
		out, err := e.lf(t, args...)
		if got := lines(out); err != nil || strings.Join(got, " ") != strings.Join(want, " ") {
			t.Errorf("lazyfork %s: %q %v, want %q", strings.Join(args, " "), got, err, want)
		}
	}
	// {{json .}}: one object a line, the fields of --format json.
	out, err := e.lf(t, "list", "--format", "{{json .}}")
	var objs []cliRow
	for _, l := range strings.Split(strings.TrimSpace(out), "\n") {
		var r cliRow
		if err := json.Unmarshal([]byte(l), &r); err != nil {
			t.Errorf("list --format '{{json .}}' line %q: %v", l, err)
			continue
		}
		objs = append(objs, r)
	}
	if err != nil || len(objs) != 2 || objs[1].ID != fork || objs[1].Parent != "counter" || objs[1].State != "running" {
		t.Errorf("list --format '{{json .}}': %+v %v\n%s", objs, err, out)
	}
	if out, err := e.lf(t, "tree", "--format", "{{.Depth}}:{{.ID}}"); err != nil || strings.TrimSpace(out) != "0:counter\n1:"+fork {
		t.Errorf("tree --format: %q %v", out, err)
	}
	if out, err := e.lf(t, "status", "--format", "{{.Containers}} {{.Running}}"); err != nil || strings.TrimSpace(out) != "2 2" {
		t.Errorf("status --format: %q %v", out, err)
	}
	if out, err := e.lf(t, "stats", fork, "--format", "{{.ID}} {{.State}}"); err != nil || strings.TrimSpace(out) != fork+" running" {
		t.Errorf("stats --format: %q %v", out, err)
	}
	if out, err := e.lf(t, "status", "--format", "{{.Nope}}"); err == nil || !strings.Contains(err.Error(), "Nope") {
		t.Errorf("a template naming no field: %q %v", out, err)
	}

	// mem: human sizes; json and templates as the other listings.
	memOut, err := e.lf(t, "mem")
	if err != nil || !strings.Contains(memOut, "SIZE") || !strings.Contains(memOut, " MiB") {
		t.Errorf("mem does not print human sizes: %v\n%s", err, memOut)
	}
	var fams []struct {
		Name  string
		Bytes int64
		Files map[string]int64
	}
	out, err = e.lf(t, "mem", "--format", "json")
	if err := json.Unmarshal([]byte(out), &fams); err != nil || len(fams) != 1 || fams[0].Bytes < 16<<20 || len(fams[0].Files) == 0 {
		t.Errorf("mem --format json: %+v %v\n%s", fams, err, out)
	}
	if out, err := e.lf(t, "mem", "--format", "{{.Name}}"); err != nil || len(fams) != 1 || strings.TrimSpace(out) != fams[0].Name {
		t.Errorf("mem --format '{{.Name}}': %q %v", out, err)
	}
	t.Logf("mem:\n%s", memOut)

	// Once every container is gone, so are the family's files: mem shows nothing.
	e.must(t, "delete", "-f", fork, "counter")
	if out, err := e.lf(t, "mem"); err != nil || strings.Contains(out, "counter") {
		t.Errorf("mem after deleting every container still shows the family: %v\n%s", err, out)
	}
	out, err = e.lf(t, "mem", "--format", "{{.Name}} {{len .Files}}")
	if err != nil || strings.TrimSpace(out) != "" {
		t.Errorf("mem after deleting every container: %q %v", out, err)
	}
	if out, err := e.lf(t, "status", "--format", "{{.Families}} {{.MemFiles}}"); err != nil || strings.TrimSpace(out) != "0 0" {
		t.Errorf("status after deleting every container: %q %v", out, err)
	}
}

// waitLogs polls `lazyfork logs NAME` until its output has a line want.
func (e *cliEnv) waitLogs(t *testing.T, name, want string) string {
	t.Helper()
	return e.waitLogsLine(t, name, func(l string) bool { return l == want })
}

// waitLogsLine polls `lazyfork logs NAME` until a line matches.
func (e *cliEnv) waitLogsLine(t *testing.T, name string, match func(string) bool) string {
	t.Helper()
	deadline := time.Now().Add(90 * time.Second)
	for {
		out, err := e.lf(t, "logs", name)
		for _, l := range strings.Split(out, "\n") {
			if match(l) {
				return out
			}
		}
		if time.Now().After(deadline) {
			t.Fatalf("lazyfork logs %s: no matching line (%v):\n%.2000s", name, err, out)
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// TestCLILogs: lazyfork logs [-f] reads the output of LazyFork containers that
// ctr (with --log-uri file://, and with its fifos) and nerdctl made; the log of
// a fork ctr removed goes with the next gc.
func TestCLILogs(t *testing.T) {
	testutil.RequiresBinary(t, "nerdctl")
	testutil.RequiresBinary(t, "ctr")
	e := startCLIEnv(t)
	ctx := e.ctx(t)
	if _, err := e.ImportImage(ctx, "python"); err != nil {
		t.Fatal(err)
	}
	ctrRun := func(id string, extra ...string) {
		args := append([]string{"run", "-d", "--runtime", lfRuntime, "--runc-root", e.RuncRoot, "--cgroup", e.CgroupPath(id)}, extra...)
		e.ctr(t, append(append(args, harness.PythonImage, id), pyHold(16, "")...)...)
	}
	ctrRun("ctr-file", "--log-uri", "file://"+filepath.Join(e.Dir, "ctr-file.log"))
	ctrRun("ctr-fifo")
	e.mustNerdctl(t, append([]string{"run", "-d", "--name", "nd", "--runtime", lfRuntime, "--net", "none",
		"--cgroup-parent", e.CgroupParent, harness.PythonImage}, pyHold(16, "")...)...)

	e.waitLogs(t, "ctr-file", "tick 2")
	// nerdctl's container by its nerdctl name, from its json-file log.
	out := e.waitLogs(t, "nd", "tick 2")
	if !strings.HasPrefix(out, "ready\ntick 1\n") {
		t.Errorf("lazyfork logs nd does not begin with the container's first lines:\n%.200s", out)
	}

	// ctr run -d without --log-uri: fifos, no past output; -f streams.
	if _, err := e.lf(t, "logs", "ctr-fifo"); err == nil || !strings.Contains(err.Error(), "lazyfork logs -f ctr-fifo") {
		t.Errorf("logs of a container writing to fifos: %v", err)
	}
	f := exec.Command(filepath.Join(e.Bin, "lazyfork"), "--address", e.Address, "--namespace", e.Namespace,
		"--root", e.Root, "--log-dir", e.logDir, "logs", "-f", "ctr-fifo")
	stdout, err := f.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := f.Start(); err != nil {
		t.Fatal(err)
	}
	r := bufio.NewReader(stdout)
	var got []string
	for len(got) < 3 {
		l, err := r.ReadString('\n')
		if err != nil {
			t.Errorf("logs -f ctr-fifo: %v after %q", err, got)
			break
		}
		if strings.HasPrefix(l, "tick ") {
			got = append(got, strings.TrimSpace(l))
		}
	}
	_ = f.Process.Signal(os.Interrupt)
	if err := f.Wait(); err != nil {
		t.Errorf("logs -f after Ctrl-C: %v", err)
	}
	t.Logf("logs -f ctr-fifo streamed %q", got)

	// A fork of ctr's container has its own log; ctr removes the fork, and
	// the log goes with the next lazyfork gc (every fork runs it too).
	fork := strings.TrimSpace(e.must(t, "fork", "ctr-file"))
	// The fork's own output: the count continues where the parent was.
	fout := e.waitLogsLine(t, fork, func(l string) bool { return strings.HasPrefix(l, "tick ") })
	if strings.Contains(fout, "ready") {
		t.Errorf("the fork's log holds its parent's output:\n%.300s", fout)
	}
	logPath := filepath.Join(e.logDir, e.Namespace, fork+".log")
	if _, err := os.Stat(logPath); err != nil {
		t.Fatalf("fork's log: %v", err)
	}
	e.ctr(t, "tasks", "kill", "-s", "SIGKILL", fork)
	for e.taskStatus(t, fork) != "STOPPED" {
		time.Sleep(50 * time.Millisecond)
	}
	e.ctr(t, "tasks", "delete", fork)
	e.ctr(t, "containers", "delete", fork)
	if out := e.must(t, "gc"); !strings.Contains(out, "log "+logPath) {
		t.Errorf("gc after ctr removed the fork:\n%s", out)
	}
	if _, err := os.Stat(logPath); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("the log of a fork ctr removed is left after gc: %v", err)
	}
	// logs -f ends with the container, its whole output printed.
	e.must(t, "create", "--name", "brief", harness.PythonImage, "--", "python3", "-c",
		"import time\nprint('one', flush=True)\ntime.sleep(1)\nprint('two', flush=True)")
	fctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	brief, err := exec.CommandContext(fctx, filepath.Join(e.Bin, "lazyfork"), "--address", e.Address, "--namespace", e.Namespace,
		"--root", e.Root, "--log-dir", e.logDir, "logs", "-f", "brief").Output()
	if fctx.Err() != nil || err != nil || string(brief) != "one\ntwo\n" {
		t.Errorf("logs -f of a container that ends: %q, %v (still following: %v)", brief, err, fctx.Err() != nil)
	}

	e.must(t, "delete", "-f", "ctr-file", "ctr-fifo", "brief")
	e.mustNerdctl(t, "rm", "-f", "nd")
}
