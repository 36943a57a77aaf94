package integration

import (
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/lazyfork/lazyfork/deploy/lima"
	"github.com/lazyfork/lazyfork/integration/harness"
	"github.com/lazyfork/lazyfork/internal/testutil"
	snapclient "github.com/lazyfork/lazyfork/snapshotter/client"
)

// vmLimactl is a limactl for the "Mac" namespace: one running instance
// whose directory holds the forwarded sockets, as Lima's would.
const vmLimactl = `#!/bin/sh
case "$*" in
"list --json") [ -e "$HOME/deleted" ] || printf '{"name":"lazyfork","status":"Running","dir":"%s","arch":"x86_64","cpus":2,"memory":4294967296}\n' "$LIMA_INSTANCE_DIR";;
"delete --force lazyfork") touch "$HOME/deleted";;
*os-release*) echo "stand-in guest (the host's namespaces)";;
*) echo "limactl stand-in: $*" >&2; exit 1;;
esac
`

// macNamespace is a mount and network namespace standing in for a Mac: it
// shares nothing with the stack but the two sockets sockforward forwards
// into it (Lima's part); LazyFork's root, containerd's state and fifo
// directory, the snapshotter's and the logs are hidden under empty tmpfs.
type macNamespace struct {
	pid  int
	env  []string
	home string
}

// run runs argv in the namespace; a non-zero exit is an error with stderr.
func (m *macNamespace) run(t *testing.T, timeout time.Duration, stdin string, argv ...string) (string, error) {
	t.Helper()
	args := append([]string{"-t", fmt.Sprint(m.pid), "-m", "-n", "--", "env", "-i"}, m.env...)
	cmd := exec.Command("nsenter", append(args, argv...)...)
	if stdin != "" {
		cmd.Stdin = strings.NewReader(stdin)
	}
	return runBounded(cmd, timeout, argv)
}

// TestCLIThroughForwardedSockets: the lazyfork CLI and an SDK program in a
// separate mount and network namespace (a Mac) reach a LazyFork stack (the
// VM) only through containerd's socket and the node API forwarded by a
// socket proxy (Lima's forwarding): vm start finds the VM's sockets and
// points the commands at them, vm status reports containerd's and the
// snapshotter's versions through them, and create, fork --count, list,
// tree, stats, mem, exec (stdin, exit status, a terminal), shell, logs,
// attach, freeze/thaw, stop, a fork of a stopped container, delete and
// clean work; vm delete leaves the commands no stack at all.
func TestCLIThroughForwardedSockets(t *testing.T) {
	for _, b := range []string{"unshare", "nsenter"} {
		testutil.RequiresBinary(t, b)
	}
	bin := lfBin(t)
	started := time.Now()
	dir, err := os.MkdirTemp("/tmp", "lfvm-")
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
	if _, err := e.ImportImage(ctx, "busybox", harness.WithSnapshotter(snapclient.SnapshotterName)); err != nil {
		t.Fatal(err)
	}
	busyRef, _ := harness.ImageRef("busybox")
	const userRef = "localhost/lazyfork/busybox-user:latest"
	userImage(t, ctx, e.Client(), busyRef, userRef, snapclient.SnapshotterName)
	cdVersion, err := e.Client().Version(ctx)
	if err != nil {
		t.Fatal(err)
	}
	repo, err := harness.RepoRoot()
	if err != nil {
		t.Fatal(err)
	}
	tools := filepath.Join(dir, "tools")
	for _, p := range []string{"sockforward", "remoteclient"} {
		build := exec.Command("go", "build", "-o", filepath.Join(tools, p), "./integration/"+p)
		build.Dir = repo
		if out, err := build.CombinedOutput(); err != nil {
			t.Fatalf("build %s: %v\n%s", p, err, out)
		}
	}
	if err := os.WriteFile(filepath.Join(tools, "limactl"), []byte(vmLimactl), 0o755); err != nil {
		t.Fatal(err)
	}
	logDir := filepath.Join(dir, "logs")

	// The guest side of the forwarding, beside the stack.
	pair, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_SEQPACKET|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	guestEnd, hostEnd := os.NewFile(uintptr(pair[0]), "guest"), os.NewFile(uintptr(pair[1]), "host")
	fwdLog := filepath.Join(dir, "sockforward.log")
	logf, err := os.Create(fwdLog)
	if err != nil {
		t.Fatal(err)
	}
	defer logf.Close()
	guest := exec.Command(filepath.Join(tools, "sockforward"), "guest", "3", "containerd="+e.Address, "api="+apiSock)
	guest.ExtraFiles, guest.Stdout, guest.Stderr = []*os.File{guestEnd}, logf, logf
	if err := guest.Start(); err != nil {
		t.Fatal(err)
	}
	// The Mac: its own mount and network namespace; the host side of the
	// forwarding listens where Lima puts an instance's sockets.
	mac := filepath.Join(dir, "mac")
	instDir := filepath.Join(mac, "lima", "lazyfork")
	address, api := filepath.Join(instDir, lima.ContainerdSocket), filepath.Join(instDir, lima.APISocket)
	if err := os.MkdirAll(mac, 0o700); err != nil {
		t.Fatal(err)
	}
	q := func(s string) string { return "'" + strings.ReplaceAll(s, "'", `'\''`) + "'" }
	var script strings.Builder
	script.WriteString("set -e\nmount -t tmpfs tmpfs " + q(mac) + "\n")
	for _, h := range []string{e.Dir, snDir, e.Root, logDir, "/run/lazyfork", "/run/containerd", "/var/lib/containerd", "/var/log/lazyfork"} {
		fmt.Fprintf(&script, "if [ -d %s ]; then mount -t tmpfs tmpfs %s; fi\n", q(h), q(h))
	}
	fmt.Fprintf(&script, "mkdir -p %s\nexec %s host 3 containerd=%s api=%s\n", q(filepath.Join(mac, "home")),
		q(filepath.Join(tools, "sockforward")), q(address), q(api))
	ns := exec.Command("unshare", "-m", "-n", "--propagation", "private", "sh", "-c", script.String())
	ns.ExtraFiles, ns.Stdout, ns.Stderr = []*os.File{hostEnd}, logf, logf
	if err := ns.Start(); err != nil {
		t.Fatal(err)
	}
	guestEnd.Close()
	hostEnd.Close()
	t.Cleanup(func() {
		for _, p := range []*exec.Cmd{ns, guest} {
			_ = p.Process.Kill()
			_ = p.Wait()
		}
		if t.Failed() {
			b, _ := os.ReadFile(fwdLog)
			t.Logf("sockforward:\n%s", b)
		}
	})
	m := &macNamespace{pid: ns.Process.Pid, home: filepath.Join(mac, "home"), env: []string{
		"PATH=" + bin + ":" + tools + ":/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
		"HOME=" + filepath.Join(mac, "home"), "XDG_CONFIG_HOME=" + filepath.Join(mac, "home", ".config"),
		"LIMACTL=" + filepath.Join(tools, "limactl"), "LIMA_INSTANCE_DIR=" + instDir,
	}}
	deadline := time.Now().Add(30 * time.Second)
	for {
		if _, err := m.run(t, 10*time.Second, "", "test", "-S", address, "-a", "-S", api); err == nil {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("the forwarded sockets did not appear in the Mac namespace")
		}
		time.Sleep(100 * time.Millisecond)
	}
	// The boundary: another network namespace; no stack paths.
	own, _ := os.Readlink("/proc/self/ns/net")
	if out, err := m.run(t, 10*time.Second, "", "readlink", "/proc/self/ns/net"); err != nil || strings.TrimSpace(out) == own {
		t.Fatalf("the Mac namespace shares the network namespace %s: %q %v", own, out, err)
	}
	if out, err := m.run(t, 10*time.Second, "", "sh", "-c", fmt.Sprintf("for d in %s %s /run/containerd /run/lazyfork; do [ ! -d $d ] || find $d -mindepth 1; done; test ! -e %s", q(e.Root), q(snDir), q(e.Address))); err != nil || strings.TrimSpace(out) != "" {
		t.Fatalf("the Mac namespace sees the stack: %q %v", out, err)
	}

	lf := func(args ...string) string {
		t.Helper()
		out, err := m.run(t, 5*time.Minute, "", append([]string{"lazyfork", "-n", e.Namespace, "--log-dir", logDir}, args...)...)
		if err != nil {
			t.Fatalf("lazyfork %s: %v\n%s", strings.Join(args, " "), err, out)
		}
		return out
	}
	waitOutput := func(id, want string) {
		t.Helper()
		deadline := time.Now().Add(60 * time.Second)
		for {
			out, err := m.run(t, time.Minute, "", "lazyfork", "-n", e.Namespace, "--log-dir", logDir, "logs", id)
			if err == nil && strings.Contains(out, want) {
				return
			}
			if time.Now().After(deadline) {
				t.Fatalf("logs %s: no %q (%v):\n%s", id, want, err, out)
			}
			time.Sleep(200 * time.Millisecond)
		}
	}

	// Before vm start the commands have no stack: the namespace has none.
	if out, err := m.run(t, time.Minute, "", "lazyfork", "list"); err == nil || !strings.Contains(err.Error(), "no containerd at /run/containerd/containerd.sock") {
		t.Fatalf("list before vm start: %v\n%s", err, out)
	}
	lf("vm", "start")
	lf("vm", "start") // idempotent
	var st struct {
		Status, Guest, Containerd, Snapshotter, Address, API string
		Default                                              bool
	}
	if err := json.Unmarshal([]byte(lf("vm", "status", "--format", "json")), &st); err != nil {
		t.Fatal(err)
	}
	if st.Status != "Running" || st.Containerd != cdVersion.Version || st.Snapshotter == "" || strings.HasPrefix(st.Snapshotter, "unreachable") ||
		st.Address != address || st.API != api || !st.Default {
		t.Errorf("vm status: %+v (containerd %s)", st, cdVersion.Version)
	}

	if id := strings.TrimSpace(lf("create", "--name", "counter", pyRef, "--", "python3", counterPy, "16", "--interval", "0.05")); id != "counter" {
		t.Fatalf("create printed %q", id)
	}
	waitOutput("counter", "tick 3")
	ids := strings.Fields(lf("fork", "counter", "--count", "2"))
	if len(ids) != 2 {
		t.Fatalf("fork --count 2 printed %q", ids)
	}
	grand := strings.TrimSpace(lf("fork", ids[0]))
	waitOutput(grand, "tick ")
	rows := func() map[string]cliRow {
		var l struct{ Containers []cliRow }
		if err := json.Unmarshal([]byte(lf("list", "--format", "json")), &l); err != nil {
			t.Fatal(err)
		}
		r := map[string]cliRow{}
		for _, x := range l.Containers {
			r[x.ID] = x
		}
		return r
	}
	r := rows()
	for _, x := range append(ids, grand, "counter") {
		if row, ok := r[x]; !ok || row.State != "running" || row.MemoryBytes <= 0 || !row.MemFile {
			t.Errorf("list row of %s: %+v", x, row)
		}
	}
	if tree := lf("tree"); !strings.Contains(tree, "── "+grand) {
		t.Errorf("tree:\n%s", tree)
	}
	var stats struct {
		RssShared int64 `json:"rssSharedBytes"`
	}
	if err := json.Unmarshal([]byte(lf("stats", grand, "--format", "json")), &stats); err != nil || stats.RssShared == 0 {
		t.Errorf("stats of %s: %+v (%v)", grand, stats, err)
	}
	if mem := lf("mem"); !strings.Contains(mem, "counter") {
		t.Errorf("mem shows no family counter:\n%s", mem)
	}

	// exec, shell: stdio crosses the node API (the shim's fifos are the
	// VM's), stdin to its end, the exit status back.
	lfIn := func(stdin string, args ...string) (string, error) {
		return m.run(t, 2*time.Minute, stdin, append([]string{"lazyfork", "-n", e.Namespace}, args...)...)
	}
	if out := lf("exec", grand, "--", "python3", "-c", "print(6 * 7)"); strings.TrimSpace(out) != "42" {
		t.Errorf("exec printed %q", out)
	}
	big := strings.Repeat("fork me\n", 20000)
	if out, err := lfIn(big, "exec", grand, "--", "python3", "-c", "import sys; d = sys.stdin.read(); print(len(d), d.count('fork me'))"); err != nil || strings.TrimSpace(out) != "160000 20000" {
		t.Errorf("exec with stdin: %q %v", out, err)
	}
	// A consumer that stalls for seconds loses nothing (the relay's flow
	// control; ttrpc alone drops a stream whose reader falls behind).
	slow := fmt.Sprintf("lazyfork -n %s exec %s -- python3 -c \"import sys; sys.stdout.write('y' * (8 << 20))\" | (sleep 3; wc -c)", e.Namespace, grand)
	if out, err := m.run(t, 2*time.Minute, "", "sh", "-c", slow); err != nil || strings.TrimSpace(out) != "8388608" {
		t.Errorf("exec into a slow reader: %q %v", out, err)
	}
	if out, err := lfIn("", "exec", grand, "--", "sh", "-c", "echo to-stderr >&2; exit 7"); err == nil || !strings.Contains(err.Error(), "to-stderr") || !strings.Contains(err.Error(), "exit status 7") {
		t.Errorf("exec's stderr and exit status: %q %v", out, err)
	}
	if out, err := lfIn("echo from-shell $((6 * 7))\n", "shell", grand); err != nil || strings.TrimSpace(out) != "from-shell 42" {
		t.Errorf("shell: %q %v", out, err)
	}
	if _, err := exec.LookPath("script"); err == nil {
		cmdline := fmt.Sprintf("lazyfork -n %s exec -t %s -- sh -c 'tty; echo cols $(stty size)'", e.Namespace, grand)
		if out, err := m.run(t, 2*time.Minute, "", "script", "-qec", cmdline, "/dev/null"); err != nil || !strings.Contains(out, "/dev/pts/") {
			t.Errorf("exec -t: %q %v", out, err)
		}
	}

	// create looks the image's user up in its /etc/passwd and /etc/group,
	// read from its layers through containerd (containerd's client would
	// mount the rootfs on this host).
	lf("create", "--name", "user", userRef, "--", "sleep", "600")
	if out := strings.TrimSpace(lf("exec", "user", "--", "id")); !strings.HasPrefix(out, "uid=1234(app) gid=1234(app) groups=") ||
		!strings.Contains(out, "777(extra)") || !strings.Contains(out, "1234(app)") {
		t.Errorf("id in a container of an image whose user is app: %q", out)
	}
	lf("delete", "-f", "user")

	// logs, attach (-f until the container goes).
	if out := lf("attach", ids[1], "--follow=false"); !strings.Contains(out, "tick ") {
		t.Errorf("attach --follow=false:\n%s", out)
	}
	followed := make(chan string, 1)
	go func() {
		out, err := m.run(t, 2*time.Minute, "", "lazyfork", "-n", e.Namespace, "--log-dir", logDir, "attach", ids[1])
		if err != nil {
			out += "\nerror: " + err.Error()
		}
		followed <- out
	}()
	time.Sleep(time.Second)
	lf("delete", "-f", ids[1])
	if out := <-followed; !strings.Contains(out, "tick ") || strings.Contains(out, "error:") {
		t.Errorf("attach of %s:\n%s", ids[1], out)
	}

	// freeze, thaw.
	lf("freeze", grand)
	if s := rows()[grand].State; s != "paused" {
		t.Errorf("state of frozen %s: %q", grand, s)
	}
	lf("thaw", grand)
	if s := rows()[grand].State; s != "running" {
		t.Errorf("state of thawed %s: %q", grand, s)
	}

	// The SDK: forks, a fork of a fork, exec (through the stdio relay) and
	// families, with only the forwarded sockets.
	sdkOut, err := m.run(t, 5*time.Minute, "", "env", "LAZYFORK_API="+api, "remoteclient", address, e.Namespace, "counter")
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

	// stop keeps a snapshot; a fork of the stopped container restores it;
	// clean deletes the stopped one, delete the others.
	lf("stop", "counter")
	revived := strings.TrimSpace(lf("fork", "counter"))
	waitOutput(revived, "tick ")
	if out := strings.Fields(lf("clean")); len(out) != 1 || out[0] != "counter" {
		t.Errorf("clean deleted %q, want counter", out)
	}
	for _, x := range []string{revived, grand, ids[0]} {
		lf("delete", "-f", x)
	}
	if out := strings.TrimSpace(lf("list", "-q")); out != "" {
		t.Errorf("containers left after delete: %q", out)
	}
	if snaps, _ := os.ReadDir(filepath.Join(e.Root, "snapshots")); len(snaps) != 0 {
		t.Errorf("snapshot dirs left: %v", snaps)
	}
	// The relay removes the fifos it made in the VM (containerd's fifo
	// directory; older leftovers of other clients are not this test's).
	fifos, _ := filepath.Glob("/run/containerd/fifo/*/exec-*")
	for _, f := range fifos {
		if fi, err := os.Stat(f); err == nil && fi.ModTime().After(started) {
			t.Errorf("the stdio relay left fifo %s", f)
		}
	}

	// vm delete: the commands lose the VM and find no stack here.
	lf("vm", "delete")
	if out, err := m.run(t, time.Minute, "", "lazyfork", "list"); err == nil || !strings.Contains(err.Error(), "no containerd at /run/containerd/containerd.sock") {
		t.Errorf("list after vm delete: %v\n%s", err, out)
	}
}
