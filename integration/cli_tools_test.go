package integration

import (
	"bufio"
	"context"
	"io"
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
	if all, err := e.lf(t, "list", "--all-runtimes"); err != nil || !strings.Contains(all, "ctr-runc") || !strings.Contains(all, ndID) {
		t.Errorf("list --all-runtimes lacks the runc containers (%v):\n%s", err, all)
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
