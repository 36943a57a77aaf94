package integration

import (
	"bytes"
	"context"
	"encoding/base64"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"sort"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/containerd/console"
	"github.com/containerd/errdefs"
	"github.com/opencontainers/go-digest"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"

	lfclient "github.com/lazyfork/lazyfork/client"
	"github.com/lazyfork/lazyfork/integration/harness"
	snapclient "github.com/lazyfork/lazyfork/snapshotter/client"
)

// The documentation's own commands (README, "From a registry").
const (
	countPy = `import itertools, time; [print(i, flush=True) or time.sleep(1) for i in itertools.count()]`
	bigPy   = `import threading; heap = bytearray(256 << 20); heap[::4096] = b"x" * len(heap[::4096]); print("heap ready", flush=True); threading.Event().wait()`
)

// pullEnv is a LazyFork stack whose containerd pulls docker.io (and the
// test hosts below) from an in-memory registry through hosts.toml.
type pullEnv struct {
	*cliEnv
	reg      *harness.Registry
	hostsDir string
	python   ocispec.Manifest // of docker.io/library/python:3.12-slim
}

func startPullEnv(t *testing.T) *pullEnv {
	t.Helper()
	bin := lfBin(t)
	reg, err := harness.StartRegistry()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { reg.Close() })
	hostsDir := t.TempDir()
	if err := harness.WriteHostsDir(hostsDir, "http://"+reg.Host, "docker.io"); err != nil {
		t.Fatal(err)
	}
	snRoot, snAddr := startSnapshotter(t, bin)
	t.Setenv("LAZYFORK_BIN", bin)
	t.Setenv("DOCKER_CONFIG", t.TempDir()) // no credentials but the test's own
	e := startLF(t, harness.Options{
		HostsDir: hostsDir,
		ProxyPlugins: []harness.ProxyPlugin{{
			Name: snapclient.SnapshotterName, Type: "snapshot", Address: snAddr, ExportsRoot: snRoot,
		}},
	})
	ctx := e.ctx(t)
	py, _, err := reg.PushImage(ctx, "python", "library/python", "3.12-slim")
	if err != nil {
		t.Fatal(err)
	}
	if _, _, err := reg.PushImage(ctx, "busybox", "library/busybox", "latest"); err != nil {
		t.Fatal(err)
	}
	return &pullEnv{cliEnv: &cliEnv{lfEnv: e, logDir: t.TempDir()}, reg: reg, hostsDir: hostsDir, python: py}
}

// lfPty runs `lazyfork ARGS` with stdin, stdout and stderr on a new pty, as
// a user at a terminal does, and returns all it printed.
func (e *cliEnv) lfPty(t *testing.T, args ...string) (string, error) {
	t.Helper()
	pty, slavePath, err := console.NewPty()
	if err != nil {
		t.Fatalf("pty: %v", err)
	}
	defer pty.Close()
	_ = pty.Resize(console.WinSize{Height: 40, Width: 160})
	slave, err := os.OpenFile(slavePath, os.O_RDWR, 0)
	if err != nil {
		t.Fatalf("pty %s: %v", slavePath, err)
	}
	full := append([]string{"--address", e.Address, "--namespace", e.Namespace, "--root", e.Root, "--log-dir", e.logDir}, args...)
	cmd := exec.Command(filepath.Join(e.Bin, "lazyfork"), full...)
	cmd.Stdin, cmd.Stdout, cmd.Stderr = slave, slave, slave
	var out bytes.Buffer
	var wg sync.WaitGroup
	wg.Add(1)
	go func() { defer wg.Done(); _, _ = io.Copy(&out, pty) }()
	err = cmd.Start()
	slave.Close()
	if err == nil {
		err = cmd.Wait()
	}
	wg.Wait() // the master reads EIO once the last slave fd is gone
	return out.String(), err
}

// manifestGets counts the registry's manifest requests for repo.
func (p *pullEnv) manifestGets(repo string) int {
	n := 0
	for _, r := range p.reg.Requests() {
		if strings.Contains(r, "/v2/"+repo+"/manifests/") {
			n++
		}
	}
	return n
}

// waitCount waits until container id has printed a number greater than
// after, and returns the last one.
func (e *cliEnv) waitCount(t *testing.T, id string, after int) (last int, first int) {
	t.Helper()
	deadline := time.Now().Add(90 * time.Second)
	for {
		out, err := e.lf(t, "attach", id, "--follow=false")
		last, first = -1, -1
		for _, l := range strings.Split(out, "\n") {
			if v, err := strconv.Atoi(strings.TrimSpace(l)); err == nil {
				if first < 0 {
					first = v
				}
				last = v
			}
		}
		if err == nil && last > after {
			return last, first
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s: no number after %d in its output (%v):\n%s", id, after, err, out)
		}
		time.Sleep(200 * time.Millisecond)
	}
}

// TestPullDocumentedSequence runs the documentation's sequence as written:
// create pulls python:3.12-slim (docker.io/library/python:3.12-slim, from
// the hosts.toml mirror) with progress on the terminal, the fork continues
// the count, big is forked 100 times and each fork holds well under 1 MB.
func TestPullDocumentedSequence(t *testing.T) {
	e := startPullEnv(t)
	ctx := e.ctx(t)

	// 1. create pulls the image it lacks, showing progress on a terminal
	// (downloads slowed to 24 MiB/s so that the big layer shows its bar).
	e.reg.LimitRate(24 << 20)
	big := e.python.Layers[0]
	for _, l := range e.python.Layers {
		if l.Size > big.Size {
			big = l
		}
	}
	out, err := e.lfPty(t, "create", "python:3.12-slim", "--name", "counter", "--", "python3", "-c", countPy)
	t.Logf("create on a pty:\n%q", out)
	if err != nil {
		t.Fatalf("create python:3.12-slim: %v\n%s", err, out)
	}
	for _, want := range []string{
		"docker.io/library/python:3.12-slim: pulling from registry docker.io (hosts " + e.hostsDir + ")",
		"layer ", "downloading", "\x1b[1A\x1b[2K", // a blob line, redrawn in place
		fmt.Sprintf("docker.io/library/python:3.12-slim: pulled %d blobs", 2+len(e.python.Layers)),
		"unpacking into lazyfork",
	} {
		if !strings.Contains(out, want) {
			t.Errorf("create's terminal output lacks %q", want)
		}
	}
	// The big layer's line ends complete with a full bar; the status line says done.
	for _, re := range []string{`layer ` + big.Digest.Encoded()[:12] + `: +complete +\|(\x1b\[32m)?\+{20,}`, `\ndone +elapsed: `} {
		if !regexp.MustCompile(re).MatchString(out) {
			t.Errorf("create's terminal output does not match %q", re)
		}
	}
	if !strings.HasSuffix(strings.TrimRight(out, "\r\n"), "\ncounter") {
		t.Errorf("create did not print the container id last: %q", out)
	}
	e.reg.LimitRate(0)
	if n := e.manifestGets("library/python"); n == 0 {
		t.Errorf("the registry served no python manifest: %v", e.reg.Requests())
	}
	img, err := e.Client().GetImage(ctx, "docker.io/library/python:3.12-slim")
	if err != nil {
		t.Fatalf("pulled image not in containerd: %v", err)
	}
	if ok, err := img.IsUnpacked(ctx, snapclient.SnapshotterName); err != nil || !ok {
		t.Errorf("pulled image not unpacked into the lazyfork snapshotter: %v %v", ok, err)
	}

	// 2. the fork continues the count.
	before, _ := e.waitCount(t, "counter", 2)
	if out := strings.TrimSpace(e.must(t, "fork", "counter", "--name", "twin")); out != "twin" {
		t.Fatalf("fork printed %q", out)
	}
	_, twinFirst := e.waitCount(t, "twin", -1)
	if twinFirst <= before {
		t.Errorf("twin starts its count at %d, not after the parent's %d before the fork", twinFirst, before)
	}
	t.Logf("counter at %d before the fork; twin continues at %d", before, twinFirst)

	// 3. big: the image is there now, no second pull.
	gets := e.manifestGets("library/python")
	if _, err := e.lf(t, "create", "python:3.12-slim", "--name", "big", "--", "python3", "-c", bigPy); err != nil {
		t.Fatalf("create big: %v", err)
	}
	if n := e.manifestGets("library/python"); n != gets {
		t.Errorf("create of a present image asked the registry again (%d manifest requests, %d before)", n, gets)
	}
	deadline := time.Now().Add(2 * time.Minute)
	for {
		o, _ := e.lf(t, "attach", "big", "--follow=false")
		if strings.Contains(o, "heap ready") {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("big never printed heap ready: %q", o)
		}
		time.Sleep(200 * time.Millisecond)
	}

	// 4. fork big --count 100, then list, status, stats --csv.
	forkStart := time.Now()
	ids := strings.Fields(e.must(t, "fork", "big", "--count", "100"))
	t.Logf("fork big --count 100 took %.1fs", time.Since(forkStart).Seconds())
	if len(ids) != 100 {
		t.Fatalf("fork big --count 100 printed %d ids", len(ids))
	}
	rows := e.list(t)
	var mems []int64
	for _, id := range ids {
		r, ok := rows[id]
		if !ok || r.State != "running" || r.Parent != "big" {
			t.Errorf("list row of fork %s: %+v", id, r)
			continue
		}
		if r.MemoryBytes <= 0 || r.MemoryBytes >= 1<<20 {
			t.Errorf("fork %s holds %d bytes, not well under 1 MB", id, r.MemoryBytes)
		}
		mems = append(mems, r.MemoryBytes)
	}
	sort.Slice(mems, func(i, j int) bool { return mems[i] < mems[j] })
	if len(mems) > 0 {
		t.Logf("100 forks of big: memory median %d, max %d bytes; big %d", mems[len(mems)/2], mems[len(mems)-1], rows["big"].MemoryBytes)
	}
	table := e.must(t, "list")
	if !strings.Contains(table, "TOTAL") || strings.Count(table, "big") < 101 {
		t.Errorf("list table:\n%s", table)
	}
	status := e.must(t, "status")
	if !strings.Contains(status, "lazyfork") {
		t.Errorf("status:\n%s", status)
	}
	csv := e.must(t, "stats", "big", "--csv")
	if lines := strings.Split(strings.TrimSpace(csv), "\n"); len(lines) != 1 || !strings.HasPrefix(lines[0], "big,big,running,") {
		t.Errorf("stats big --csv:\n%s", csv)
	}
	lines := strings.Split(strings.TrimRight(table, "\n"), "\n")
	if len(lines) > 8 {
		lines = append(append(lines[:5:5], "..."), lines[len(lines)-3:]...)
	}
	t.Logf("list:\n%s\nstatus:\n%s\nstats big --csv --header:\n%s", strings.Join(lines, "\n"), status, e.must(t, "stats", "big", "--csv", "--header"))
}

// pullFailed checks that a failed create left no container, no image and
// no lease, and that what it fetched goes with the next garbage collection.
func (p *pullEnv) pullFailed(t *testing.T, ctx context.Context, name, ref string, fetched []string) {
	t.Helper()
	cl := p.Client()
	if _, err := cl.LoadContainer(ctx, name); !errdefs.IsNotFound(err) {
		t.Errorf("container %s after a failed pull: %v", name, err)
	}
	if _, err := cl.ImageService().Get(ctx, ref); !errdefs.IsNotFound(err) {
		t.Errorf("image %s after a failed pull: %v", ref, err)
	}
	if ls, err := cl.LeasesService().List(ctx); err != nil || len(ls) != 0 {
		t.Errorf("leases after a failed pull: %v %v", ls, err)
	}
	deadline := time.Now().Add(60 * time.Second)
	for _, d := range fetched {
		for {
			_, err := cl.ContentStore().Info(ctx, digest.Digest(d))
			if errdefs.IsNotFound(err) {
				break
			}
			if time.Now().After(deadline) {
				t.Errorf("blob %s of the failed pull still in the content store: %v", d, err)
				break
			}
			time.Sleep(200 * time.Millisecond)
		}
	}
	ings, err := cl.ContentStore().ListStatuses(ctx)
	if err != nil || len(ings) != 0 {
		t.Errorf("ingests left after a failed pull: %v %v", ings, err)
	}
}

// pullOpts are the library's options for the test's registry configuration.
func pullOpts(p *pullEnv) lfclient.PullOptions {
	return lfclient.PullOptions{HostsDirs: []string{p.hostsDir}, DockerConfig: os.Getenv("DOCKER_CONFIG")}
}

// TestPullErrors: a missing tag, a missing blob, an unreachable registry, a
// host that does not resolve, a registry refusing anonymous pulls, and
// --pull never each fail with what failed, and leave nothing behind.
func TestPullErrors(t *testing.T) {
	e := startPullEnv(t)
	ctx := e.ctx(t)

	// A port nobody listens on.
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	closed := ln.Addr().String()
	ln.Close()
	if err := harness.WriteHostsDir(e.hostsDir, "http://"+closed, "unreachable.lazyfork.test"); err != nil {
		t.Fatal(err)
	}
	// A registry that wants a password.
	priv, err := harness.StartRegistry()
	if err != nil {
		t.Fatal(err)
	}
	defer priv.Close()
	if _, _, err := priv.PushImage(ctx, "busybox", "team/tool", "1.0"); err != nil {
		t.Fatal(err)
	}
	priv.RequireBasicAuth("alice", "s3cret")
	if err := harness.WriteHostsDir(e.hostsDir, "http://"+priv.Host, "private.lazyfork.test"); err != nil {
		t.Fatal(err)
	}
	// busybox:broken: a manifest whose layer the registry lost.
	m, md, err := e.reg.PushImage(ctx, "busybox", "library/busybox", "broken")
	if err != nil {
		t.Fatal(err)
	}
	e.reg.DropBlob(m.Layers[0].Digest.String())

	for _, c := range []struct {
		name, image, ref string
		want             []string
		fetched          []string // blobs the pull got before it failed
	}{
		{"nf", "python:nosuch", "docker.io/library/python:nosuch",
			[]string{"pull docker.io/library/python:nosuch: not found", "check the name and tag"}, nil},
		{"half", "busybox:broken", "docker.io/library/busybox:broken",
			[]string{"pull docker.io/library/busybox:broken: not found", m.Layers[0].Digest.String(), "lacks one of its blobs"},
			[]string{md.Digest.String()}}, // the manifest comes before its blobs
		{"unreach", "unreachable.lazyfork.test/app:1", "unreachable.lazyfork.test/app:1",
			[]string{"pull unreachable.lazyfork.test/app:1: network:", "connection refused", "cannot be reached", e.hostsDir}, nil},
		{"nodns", "nosuchhost.invalid/app:1", "nosuchhost.invalid/app:1",
			[]string{"pull nosuchhost.invalid/app:1: name resolution:", "no such host", "does not resolve"}, nil},
		{"auth", "private.lazyfork.test/team/tool:1.0", "private.lazyfork.test/team/tool:1.0",
			[]string{"pull private.lazyfork.test/team/tool:1.0: authentication:", "config.json has no credentials for " + priv.Host, "nerdctl login " + priv.Host}, nil},
	} {
		_, err := e.lf(t, "create", c.image, "--name", c.name, "--", "true")
		if err == nil {
			t.Errorf("create %s succeeded", c.image)
			continue
		}
		t.Logf("create %s: %v", c.image, err)
		for _, w := range c.want {
			if !strings.Contains(err.Error(), w) {
				t.Errorf("create %s: error lacks %q: %v", c.image, w, err)
			}
		}
		for _, d := range c.fetched {
			if !slices.ContainsFunc(e.reg.Requests(), func(r string) bool {
				return strings.HasPrefix(r, "GET ") && (strings.HasSuffix(r, "/blobs/"+d) || strings.HasSuffix(r, "/manifests/"+d))
			}) {
				t.Errorf("create %s did not fetch %s before failing: %v", c.image, d, e.reg.Requests())
			}
		}
		e.pullFailed(t, ctx, c.name, c.ref, c.fetched)
	}

	// Ctrl-C in the middle of a download: nothing of it stays.
	big := e.python.Layers[0]
	for _, l := range e.python.Layers {
		if l.Size > big.Size {
			big = l
		}
	}
	e.reg.LimitRate(4 << 20)
	intr := exec.Command(filepath.Join(e.Bin, "lazyfork"), "--address", e.Address, "--namespace", e.Namespace, "--root", e.Root,
		"--log-dir", e.logDir, "create", "python:3.12-slim", "--name", "intr", "--", "true")
	var intrErr bytes.Buffer
	intr.Stderr = &intrErr
	if err := intr.Start(); err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(60 * time.Second)
	for !slices.Contains(e.reg.Requests(), "GET /v2/library/python/blobs/"+big.Digest.String()) && time.Now().Before(deadline) {
		time.Sleep(20 * time.Millisecond)
	}
	_ = intr.Process.Signal(os.Interrupt)
	if err := intr.Wait(); err == nil || !strings.Contains(intrErr.String(), "pull docker.io/library/python:3.12-slim: context canceled") {
		t.Errorf("create interrupted during the download: %v\n%s", err, intrErr.String())
	}
	e.reg.LimitRate(0)
	e.pullFailed(t, ctx, "intr", "docker.io/library/python:3.12-slim", []string{big.Digest.String(), e.python.Config.Digest.String()})

	// The library call gives the errdefs class.
	lf := e.lfClient()
	for ref, class := range map[string]error{
		"docker.io/library/python:nosuch": errdefs.ErrNotFound,
		"unreachable.lazyfork.test/app:1": errdefs.ErrUnavailable,
	} {
		if _, err := lf.Image(ctx, ref, pullOpts(e)); !errors.Is(err, class) {
			t.Errorf("Image(%s): %v, want %v", ref, err, class)
		}
	}

	// With credentials in config.json the same pull works.
	cfgDir := os.Getenv("DOCKER_CONFIG")
	auth := base64.StdEncoding.EncodeToString([]byte("alice:s3cret"))
	cfg := fmt.Sprintf(`{"auths": {%q: {"auth": %q}}}`, "http://"+priv.Host, auth)
	if err := os.WriteFile(filepath.Join(cfgDir, "config.json"), []byte(cfg), 0o600); err != nil {
		t.Fatal(err)
	}
	e.must(t, "create", "private.lazyfork.test/team/tool:1.0", "--name", "authed", "--", "true")

	// --pull never: a missing image is an error and the registry hears nothing.
	before := len(e.reg.Requests())
	if _, err := e.lf(t, "create", "busybox", "--pull", "never", "--name", "never", "--", "true"); err == nil ||
		!strings.Contains(err.Error(), "docker.io/library/busybox:latest is not in containerd and --pull=never") {
		t.Errorf("--pull never of a missing image: %v", err)
	}
	if n := len(e.reg.Requests()); n != before {
		t.Errorf("--pull never asked the registry: %v", e.reg.Requests()[before:])
	}
	e.pullFailed(t, ctx, "never", "docker.io/library/busybox:latest", nil)
	// busybox (short) pulls; --pull always asks again; --pull bad is refused.
	e.must(t, "create", "busybox", "--name", "bb1", "--", "true")
	gets := e.manifestGets("library/busybox")
	e.must(t, "create", "busybox", "--name", "bb2", "--", "true")
	if n := e.manifestGets("library/busybox"); n != gets {
		t.Errorf("--pull missing of a present image asked the registry")
	}
	e.must(t, "create", "busybox", "--pull", "always", "--name", "bb3", "--", "true")
	if n := e.manifestGets("library/busybox"); n == gets {
		t.Errorf("--pull always did not ask the registry")
	}
	if _, err := e.lf(t, "create", "busybox", "--pull", "sometimes", "--", "true"); err == nil || !strings.Contains(err.Error(), "want missing, always or never") {
		t.Errorf("--pull sometimes: %v", err)
	}
	// Without a terminal, progress is two lines on stderr and stdout is the id.
	cmd := exec.Command(filepath.Join(e.Bin, "lazyfork"), "--address", e.Address, "--namespace", e.Namespace, "--root", e.Root,
		"--log-dir", e.logDir, "create", "busybox", "--pull", "always", "--name", "bb4", "--", "true")
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	if err := cmd.Run(); err != nil || strings.TrimSpace(stdout.String()) != "bb4" {
		t.Errorf("create without a terminal: %v, stdout %q", err, stdout.String())
	}
	if lines := strings.Split(strings.TrimSpace(stderr.String()), "\n"); len(lines) != 2 || strings.Contains(stderr.String(), "\x1b") ||
		!strings.Contains(lines[1], "docker.io/library/busybox:latest: pulled") {
		t.Errorf("progress without a terminal:\n%s", stderr.String())
	}
}
