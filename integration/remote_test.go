package integration

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/lazyfork/lazyfork/integration/harness"
	"github.com/lazyfork/lazyfork/internal/testutil"
	snapclient "github.com/lazyfork/lazyfork/snapshotter/client"
)

// onlySockets runs commands in a mount namespace where the node is reduced
// to two sockets: containerd's and LazyFork's node API, bound back at their
// paths into empty tmpfs mounts that hide the harness's directory (containerd's
// state, the shims' bundles), the snapshotter's directory, LazyFork's root,
// the containers' log directory and /run/lazyfork.
type onlySockets struct {
	stage   string
	sockets []string
	hide    []string
	root    string
}

// script is the sh script that sets the namespace up, then runs "$@".
func (o *onlySockets) script(withAPI bool) string {
	q := func(s string) string { return "'" + strings.ReplaceAll(s, "'", `'\''`) + "'" }
	var b strings.Builder
	b.WriteString("set -e\nmount -t tmpfs tmpfs " + q(o.stage) + "\n")
	for i, s := range o.sockets {
		fmt.Fprintf(&b, "touch %s/%d\nmount --bind %s %s/%d\n", q(o.stage), i, q(s), q(o.stage), i)
	}
	for _, h := range append(o.hide, "/run/lazyfork") {
		fmt.Fprintf(&b, "if [ -d %s ]; then mount -t tmpfs tmpfs %s; fi\n", q(h), q(h))
	}
	for i, s := range o.sockets {
		if !withAPI && i > 0 {
			continue // the API socket is absent
		}
		fmt.Fprintf(&b, "mkdir -p %s\ntouch %s\nmount --bind %s/%d %s\n", q(filepath.Dir(s)), q(s), q(o.stage), i, q(s))
	}
	fmt.Fprintf(&b, "if [ -n \"$(ls -A %s)\" ]; then echo 'LazyFork root still visible' >&2; exit 99; fi\n", q(o.root))
	b.WriteString("exec \"$@\"\n")
	return b.String()
}

// run runs argv in the namespace; a non-zero exit is an error with stderr.
func (o *onlySockets) run(t *testing.T, withAPI bool, timeout time.Duration, argv ...string) (string, error) {
	t.Helper()
	cmd := exec.Command("unshare", append([]string{"-m", "--propagation", "private", "sh", "-c", o.script(withAPI), "sh"}, argv...)...)
	return runBounded(cmd, timeout, argv)
}

// runBounded runs cmd and returns its stdout; a non-zero exit is an error
// with its stderr, and a command still running after timeout is killed and
// reported as hanging (argv names it).
func runBounded(cmd *exec.Cmd, timeout time.Duration, argv []string) (string, error) {
	var out, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &stderr
	if err := cmd.Start(); err != nil {
		return "", err
	}
	done := make(chan error, 1)
	go func() { done <- cmd.Wait() }()
	select {
	case err := <-done:
		if err != nil {
			return out.String(), errors.New(strings.TrimSpace(stderr.String()) + " (" + err.Error() + ")")
		}
		return out.String(), nil
	case <-time.After(timeout):
		_ = cmd.Process.Signal(syscall.SIGKILL)
		<-done
		return out.String(), fmt.Errorf("%v: still running after %v (hangs): %s", argv, timeout, stderr.String())
	}
}

// TestClientsWithOnlySockets: the CLI and an SDK program that see only
// containerd's socket and LazyFork's node API (no LazyFork root, no
// containerd state, no logs) create, fork (n, of a fork), list, tree,
// stats, mem, exec, logs, stop and delete; without the API socket the same
// commands fail at once, saying where the API was looked for.
func TestClientsWithOnlySockets(t *testing.T) {
	testutil.RequiresBinary(t, "unshare")
	bin := lfBin(t)
	dir, err := os.MkdirTemp("/tmp", "lfapi-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	snDir := filepath.Join(dir, "sn")
	snRoot, snAddr := filepath.Join(snDir, "root"), filepath.Join(snDir, "sn.sock")
	e := startLF(t, harness.Options{ProxyPlugins: []harness.ProxyPlugin{{
		Name: snapclient.SnapshotterName, Type: "snapshot", Address: snAddr, ExportsRoot: snRoot,
	}}})
	apiSock := snapclient.TTRPCAddress(snAddr)
	startNodeSnapshotter(t, bin, snRoot, snAddr, e.Root)
	ctx := e.ctx(t)
	if _, err := e.ImportImage(ctx, "python", harness.WithSnapshotter(snapclient.SnapshotterName)); err != nil {
		t.Fatal(err)
	}
	pyRef, _ := harness.ImageRef("python")
	repo, err := harness.RepoRoot()
	if err != nil {
		t.Fatal(err)
	}
	sdk := filepath.Join(dir, "remoteclient")
	build := exec.Command("go", "build", "-o", sdk, "./integration/remoteclient")
	build.Dir = repo
	if out, err := build.CombinedOutput(); err != nil {
		t.Fatalf("build the SDK program: %v\n%s", err, out)
	}
	logDir := filepath.Join(dir, "logs")
	stage := filepath.Join(dir, "stage")
	if err := os.MkdirAll(stage, 0o700); err != nil {
		t.Fatal(err)
	}
	ns := &onlySockets{stage: stage, sockets: []string{e.Address, apiSock}, hide: []string{e.Dir, snDir, e.Root, logDir}, root: e.Root}
	lfArgs := func(args ...string) []string {
		return append([]string{filepath.Join(bin, "lazyfork"), "--address", e.Address, "--namespace", e.Namespace,
			"--api", apiSock, "--log-dir", logDir}, args...)
	}
	lf := func(args ...string) string {
		t.Helper()
		out, err := ns.run(t, true, 5*time.Minute, lfArgs(args...)...)
		if err != nil {
			t.Fatalf("lazyfork %s: %v\n%s", strings.Join(args, " "), err, out)
		}
		return out
	}
	waitOutput := func(id, want string) string {
		t.Helper()
		deadline := time.Now().Add(60 * time.Second)
		for {
			out, err := ns.run(t, true, time.Minute, lfArgs("logs", id)...)
			if err == nil && strings.Contains(out, want) {
				return out
			}
			if time.Now().After(deadline) {
				t.Fatalf("logs %s: no %q (%v):\n%s", id, want, err, out)
			}
			time.Sleep(200 * time.Millisecond)
		}
	}

	if id := strings.TrimSpace(lf("create", "--name", "counter", pyRef, "--", "python3", counterPy, "16", "--interval", "0.05")); id != "counter" {
		t.Fatalf("create printed %q", id)
	}
	waitOutput("counter", "tick 3")
	ids := strings.Fields(lf("fork", "counter", "--count", "2"))
	if len(ids) != 2 {
		t.Fatalf("fork -n 2 printed %q", ids)
	}
	grand := strings.TrimSpace(lf("fork", ids[0]))
	waitOutput(grand, "tick ")
	var l struct {
		Containers []cliRow
	}
	if err := json.Unmarshal([]byte(lf("list", "--format", "json")), &l); err != nil {
		t.Fatal(err)
	}
	rows := map[string]cliRow{}
	for _, r := range l.Containers {
		rows[r.ID] = r
	}
	for _, x := range append(ids, grand, "counter") {
		// Memory and memory-file columns come from the node API.
		if r, ok := rows[x]; !ok || r.State != "running" || r.MemoryBytes <= 0 || !r.MemFile || r.MemFileBytes < 16<<20 {
			t.Errorf("list row of %s: %+v", x, r)
		}
	}
	if r := rows[grand]; r.Parent != ids[0] || r.Depth != 2 {
		t.Errorf("grandchild in list: %+v", r)
	}
	if tree := lf("tree"); !strings.Contains(tree, "── "+grand) {
		t.Errorf("tree:\n%s", tree)
	}
	var st struct {
		SnapshotPages uint64
		SnapshotBytes int64
		RssShared     int64 `json:"rssSharedBytes"`
	}
	if err := json.Unmarshal([]byte(lf("stats", grand, "--format", "json")), &st); err != nil {
		t.Fatal(err)
	}
	if st.RssShared == 0 {
		t.Errorf("stats of %s through the API: %+v", grand, st)
	}
	if mem := lf("mem"); !strings.Contains(mem, "counter") {
		t.Errorf("mem shows no family counter:\n%s", mem)
	}
	if out := lf("exec", grand, "--", "python3", "-c", "print(6 * 7)"); strings.TrimSpace(out) != "42" {
		t.Errorf("exec printed %q", out)
	}
	// logs -f follows until the container ends.
	followed := make(chan string, 1)
	go func() {
		out, err := ns.run(t, true, 2*time.Minute, lfArgs("logs", "-f", ids[1])...)
		if err != nil {
			out += "\nerror: " + err.Error()
		}
		followed <- out
	}()
	time.Sleep(time.Second)
	lf("delete", "-f", ids[1])
	if out := <-followed; !strings.Contains(out, "tick ") || strings.Contains(out, "error:") {
		t.Errorf("logs -f of %s:\n%s", ids[1], out)
	}

	// The SDK: forks, a fork of a fork, exec and families through the API
	// it finds by default ($LAZYFORK_API).
	sdkOut, err := ns.run(t, true, 5*time.Minute, "env", "LAZYFORK_API="+apiSock, sdk, e.Address, e.Namespace, "counter")
	if err != nil {
		t.Fatalf("SDK program: %v\n%s", err, sdkOut)
	}
	var rep struct {
		Forks    []string
		Grand    string
		Exec     string
		Families []string
	}
	if err := json.Unmarshal([]byte(sdkOut), &rep); err != nil || len(rep.Forks) != 2 || rep.Grand == "" || rep.Exec != "hello from 42" || len(rep.Families) == 0 {
		t.Errorf("SDK program printed %q (%v)", sdkOut, err)
	}

	// Without the API socket: clean failures, at once.
	for _, args := range [][]string{
		{"fork", "counter"}, {"list"}, {"stats", "counter"}, {"mem"}, {"logs", "counter"}, {"stop", "counter"}, {"gc"},
	} {
		out, err := ns.run(t, false, time.Minute, lfArgs(args...)...)
		if err == nil || !strings.Contains(err.Error(), apiSock) || strings.Contains(err.Error(), "hangs") {
			t.Errorf("lazyfork %s without the API socket: %v\n%s", strings.Join(args, " "), err, out)
		}
	}
	sdkOut, err = ns.run(t, false, time.Minute, "env", "LAZYFORK_API="+apiSock, sdk, e.Address, e.Namespace, "counter")
	if err == nil || !strings.Contains(err.Error(), "no LazyFork API at "+apiSock) {
		t.Errorf("SDK program without the API socket: %v\n%s", err, sdkOut)
	}
	if out := lf("list", "-q"); strings.Contains(out, "lazyfork-") {
		t.Errorf("the failed calls left containers:\n%s", out)
	}

	// stop keeps a snapshot through the API; a fork of the stopped
	// container restores from it; delete removes it.
	lf("stop", "counter")
	st.SnapshotPages, st.SnapshotBytes = 0, 0
	if err := json.Unmarshal([]byte(lf("stats", "counter", "--format", "json")), &st); err != nil {
		t.Fatal(err)
	}
	if st.SnapshotPages == 0 || st.SnapshotBytes == 0 {
		t.Errorf("stats of the stopped counter through the API: %+v", st)
	}
	revived := strings.TrimSpace(lf("fork", "counter"))
	waitOutput(revived, "tick ")
	for _, x := range []string{revived, grand, ids[0], "counter"} {
		lf("delete", "-f", x)
	}
	if out := strings.TrimSpace(lf("list", "-q")); out != "" {
		t.Errorf("containers left after delete: %q", out)
	}
	if snaps, _ := os.ReadDir(filepath.Join(e.Root, "snapshots")); len(snaps) != 0 {
		t.Errorf("snapshot dirs left: %v", snaps)
	}
}

// startNodeSnapshotter starts lazyfork-snapshotter serving LazyFork root
// lfRoot on its node API (address's ttrpc socket) and waits for it.
func startNodeSnapshotter(t *testing.T, bin, root, address, lfRoot string) {
	t.Helper()
	if err := os.MkdirAll(filepath.Dir(address), 0o700); err != nil {
		t.Fatal(err)
	}
	runSnapshotter(t, bin, filepath.Join(filepath.Dir(filepath.Dir(address)), "snapshotter.log"), "", func() error {
		_, err := os.Stat(snapclient.TTRPCAddress(address))
		return err
	}, "--root", root, "--address", address, "--lazyfork-root", lfRoot, "--memory-gc-interval", testMemoryGCInterval())
}
