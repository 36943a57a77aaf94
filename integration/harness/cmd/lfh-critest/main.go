// Command lfh-critest runs the Kubernetes CRI validation suite (critest, from
// sigs.k8s.io/cri-tools) against a private containerd with a runc and a
// lazyfork handler, offline, and prints their results side by side
// (`make critest`).
//
// Everything critest pulls is served by a local registry (go-containerregistry's,
// in memory) as stand-ins built from LazyFork's cached test images
// (critestImages), and containerd reaches it for registry.k8s.io, gcr.io and
// k8s.gcr.io through hosts.toml. Pods get a private bridge network with
// portmap. The lazyfork handler is the one `lazyfork setup` writes (LazyFork's
// runtime type, the annotations, no [options]).
//
// It exits 1 when the lazyfork handler fails a test the runc handler passes.
package main

import (
	"context"
	"encoding/xml"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"runtime"
	"sort"
	"strings"
	"syscall"
	"time"

	ocispec "github.com/opencontainers/image-spec/specs-go/v1"

	"github.com/lazyfork/lazyfork/integration/harness"
)

const (
	e2e = "registry.k8s.io/e2e-test-images/"
	cri = "gcr.io/k8s-staging-cri-tools/"
)

// passwd and group hold the base image's entries (busybox-static's /etc).
const (
	basePasswd = "root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534:nobody:/nonexistent:/bin/false\n"
	baseGroup  = "root:x:0:\nnogroup:x:65534:\n"
)

// Scripts for what critest runs in the busybox image that busybox-static
// lacks or has differently.
const (
	// /bin/ls a file of its own (not a symlink to /bin/busybox), so that a
	// masked /bin/ls masks only ls, as in the real image (hard links).
	lsScript = "#!/bin/sh\nexec /bin/busybox ls \"$@\"\n"
	// procps's pgrep NAME: the pids of processes named NAME.
	pgrepScript = `#!/bin/sh
found=1
for d in /proc/[0-9]*; do
	[ "$(cat "$d/comm" 2>/dev/null)" = "$1" ] || continue
	echo "${d#/proc/}"
	found=0
done
exit $found
`
	// util-linux's ipcs -m: the shared memory segments of this IPC namespace.
	ipcsScript = `#!/bin/sh
echo "------ Shared Memory Segments --------"
echo "key        shmid      owner      perms      bytes      nattch     status"
{
	read -r _
	while read -r key shmid perms size _; do echo "$key $shmid root $perms $size"; done
} </proc/sysvipc/shm
`
	// nginx: a process named nginx (pidof), "master process" in PID 1's
	// command line, its pid in /var/run/nginx.pid, serving port 80.
	nginxScript = `#!/bin/sh
mkdir -p /var/run
echo $$ >/var/run/nginx.pid
echo "nginx stand-in: httpd on port 80"
httpd -f -v -p 80 -h /www
`
)

// webServer stands in for nginx/httpd: busybox httpd serving an index page
// on port, logging a line that names it first (critest looks for "httpd" in
// the httpd container's log).
func webServer(name string, port int) harness.StandIn {
	return harness.StandIn{
		Base:  "busybox",
		Files: map[string]string{"www/index.html": "<html><body>" + name + " stand-in</body></html>\n"},
		Edit: func(c *ocispec.ImageConfig) {
			c.Cmd = []string{"sh", "-c", fmt.Sprintf("echo %s stand-in: httpd on port %d; exec httpd -f -v -p %d -h /www", name, port, port)}
			c.ExposedPorts = map[string]struct{}{fmt.Sprintf("%d/tcp", port): {}}
		},
	}
}

func user(u string) func(*ocispec.ImageConfig) {
	return func(c *ocispec.ImageConfig) { c.User = u }
}

// critestImages is every image critest v1.37.0 pulls on Linux (see
// pkg/validate/consts*.go and pkg/framework/util.go there), as stand-ins
// that do what the tests ask of them (cri-tools' images/ say how the real
// ones are made).
func critestImages(nnp string) []harness.StandIn {
	wwwData := map[string]string{
		"etc/passwd": basePasswd + "www-data:x:33:33:www-data:/var/www:/bin/false\n",
		"etc/group":  baseGroup + "www-data:x:33:\n",
	}
	ims := []harness.StandIn{
		{Base: "busybox", Refs: []string{e2e + "busybox:1.29-2"},
			Files: map[string]string{"bin/ls": lsScript, "usr/bin/pgrep": pgrepScript, "usr/bin/ipcs": ipcsScript},
			Modes: map[string]int64{"bin/ls": 0o755, "usr/bin/pgrep": 0o755, "usr/bin/ipcs": 0o755}},
		{Base: "busybox", Refs: []string{e2e + "nginx:1.14-2"},
			Files: map[string]string{"usr/sbin/nginx": nginxScript, "www/index.html": "<html><body>nginx stand-in</body></html>\n"},
			Modes: map[string]int64{"usr/sbin/nginx": 0o755},
			Edit: func(c *ocispec.ImageConfig) {
				c.Cmd = []string{"/usr/sbin/nginx", "-g", "daemon off; master process"}
				c.ExposedPorts = map[string]struct{}{"80/tcp": {}}
			}},
		// e2e-test-images/nonewprivs: a setuid-root program printing its euid.
		{Base: "busybox", Refs: []string{e2e + "nonewprivs:1.3"},
			Files: map[string]string{"usr/local/bin/nnp": nnp},
			Modes: map[string]int64{"usr/local/bin/nnp": 0o4755},
			Edit:  func(c *ocispec.ImageConfig) { c.Cmd = []string{"/usr/local/bin/nnp"} }},
		// Two names of one image (a file of its own keeps it apart from the
		// sandbox image: the test counts its tags).
		{Base: "pause", Refs: []string{"registry.k8s.io/pause:3.9", "k8s.gcr.io/pause:3.9"}, Files: map[string]string{"pause-3.9": ""}},
		// The sandbox image too: the image tests remove it, and CRI pulls it again.
		{Base: "pause", Refs: []string{harness.PauseImage}},
		// images/image-user
		{Base: "busybox", Refs: []string{cri + "test-image-user-uid"}, Edit: user("1002")},
		{Base: "busybox", Refs: []string{cri + "test-image-user-username"}, Files: wwwData, Edit: user("www-data")},
		{Base: "busybox", Refs: []string{cri + "test-image-user-uid-group"}, Edit: user("1003:1004")},
		{Base: "busybox", Refs: []string{cri + "test-image-user-username-group"}, Files: wwwData, Edit: user("www-data:1004")},
		// images/image-predefined-group
		{Base: "busybox", Refs: []string{cri + "test-image-predefined-group"}, Edit: user("1000"), Files: map[string]string{
			"etc/passwd": basePasswd + "default-user:x:1000:1000::/home/default-user:/bin/sh\n",
			"etc/group":  baseGroup + "default-user:x:1000:\ngroup-defined-in-image:x:50000:default-user\n",
		}},
		// images/image-test: busybox plus a file named after the image. The
		// digest-pinned reference cannot be reproduced: pushed by tag, its
		// pull fails for every handler alike.
		{Base: "busybox", Refs: []string{cri + "test-image-tags:1", cri + "test-image-tags:2", cri + "test-image-tags:3"}, Files: map[string]string{"test-image-tags": ""}},
	}
	for _, name := range []string{"test-image-latest", "test-image-tag:test", "test-image-tag:all", "test-image-1:latest", "test-image-2:latest", "test-image-3:latest",
		"test-image-digest@sha256:9700f9a2f5bf2c45f2f605a0bd3bce7cf37420ec9d3ed50ac2758413308766bf"} {
		file := strings.NewReplacer(":", "-", "@", "-").Replace(name)
		ims = append(ims, harness.StandIn{Base: "busybox", Refs: []string{cri + name}, Files: map[string]string{file: ""}})
	}
	for _, w := range []struct {
		ref, name string
		port      int
	}{
		{e2e + "httpd:2.4.39-4", "httpd", 80},
		{cri + "hostnet-nginx-" + runtime.GOARCH, "hostnet-nginx", 12003},
	} {
		s := webServer(w.name, w.port)
		s.Refs = []string{w.ref}
		ims = append(ims, s)
	}
	return ims
}

type options struct {
	critest, bin, out string
	handlers          []string
	skip, focus       string
	keep, snapshotter bool
}

func main() {
	var o options
	var handlers string
	flag.StringVar(&o.critest, "critest", "bin/critest", "critest binary (scripts/critest.sh builds it)")
	flag.StringVar(&o.bin, "bin", "bin", "directory with LazyFork's binaries (make build)")
	flag.StringVar(&o.out, "out", "", "directory for critest's logs and JUnit reports (default: a new one under /tmp)")
	flag.StringVar(&handlers, "handlers", "runc,lazyfork", "CRI runtime handlers to run the suite under, in order")
	flag.StringVar(&o.skip, "skip", "", "ginkgo skip regexp passed to critest")
	flag.StringVar(&o.focus, "focus", "", "ginkgo focus regexp passed to critest")
	flag.BoolVar(&o.keep, "keep", false, "leave the private containerd and LazyFork root in place for inspection (then: go run ./integration/harness/cmd/lfh-reap DIR)")
	flag.BoolVar(&o.snapshotter, "snapshotter", false, "also run the suite under handler lazyfork-snapshotter: the lazyfork handler with LazyFork's snapshotter (a proxy plugin)")
	flag.Parse()
	o.handlers = strings.Split(handlers, ",")
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	code, err := run(ctx, o)
	if err != nil {
		fmt.Fprintln(os.Stderr, "lfh-critest:", err)
		os.Exit(2)
	}
	os.Exit(code)
}

func run(ctx context.Context, o options) (int, error) {
	for _, p := range []*string{&o.critest, &o.bin} {
		a, err := filepath.Abs(*p)
		if err != nil {
			return 0, err
		}
		*p = a
	}
	if _, err := os.Stat(o.critest); err != nil {
		return 0, fmt.Errorf("no critest binary (build it with scripts/critest.sh): %w", err)
	}
	if _, err := os.Stat(filepath.Join(o.bin, "containerd-shim-lazyfork-v1-full")); err != nil {
		return 0, fmt.Errorf("no LazyFork shim in %s (make build): %w", o.bin, err)
	}
	if o.out == "" {
		d, err := os.MkdirTemp("/tmp", "critest-")
		if err != nil {
			return 0, err
		}
		o.out = d
	}

	t0 := time.Now()
	reg, err := harness.StartRegistry()
	if err != nil {
		return 0, err
	}
	defer reg.Close()
	hosts := map[string]bool{}
	nnp, err := buildNNP(ctx, o.out)
	if err != nil {
		return 0, err
	}
	for _, s := range critestImages(nnp) {
		if _, err := reg.PushStandIn(ctx, s); err != nil {
			return 0, fmt.Errorf("stand-in for %v: %w", s.Refs, err)
		}
		for _, r := range s.Refs {
			hosts[r[:strings.Index(r, "/")]] = true
		}
	}
	hostsDir := filepath.Join(o.out, "hosts.d")
	var hostList []string
	for h := range hosts {
		hostList = append(hostList, h)
	}
	sort.Strings(hostList)
	if err := harness.WriteHostsDir(hostsDir, "http://"+reg.Host, hostList...); err != nil {
		return 0, err
	}

	root, err := os.MkdirTemp("/tmp", "lfr-critest-")
	if err != nil {
		return 0, err
	}
	defer func() {
		if o.keep {
			fmt.Fprintf(os.Stderr, "lfh-critest: kept LazyFork root %s\n", root)
			return
		}
		if err := harness.RemoveLazyForkRoot(root); err != nil {
			fmt.Fprintf(os.Stderr, "lfh-critest: remove LazyFork root %s: %v\n", root, err)
		}
	}()
	lf := harness.Runtime{
		Name:                 "lazyfork",
		Type:                 "io.containerd.lazyfork.v1",
		NoOptions:            true,
		PodAnnotations:       []string{"lazyfork.io/*"},
		ContainerAnnotations: []string{"lazyfork.io/*"},
	}
	hopts := harness.Options{
		EnableCRI: true,
		BinDirs:   []string{o.bin},
		Env:       []string{"LAZYFORK_ROOT=" + root},
		HostsDir:  hostsDir,
		Runtimes:  []harness.Runtime{lf},
	}
	if o.snapshotter {
		snRoot, address, stopSn, err := startSnapshotter(o.bin, o.out, root)
		if err != nil {
			return 0, err
		}
		defer stopSn()
		hopts.ProxyPlugins = []harness.ProxyPlugin{{Name: "lazyfork", Address: address, ExportsRoot: snRoot}}
		sn := lf
		sn.Name, sn.Snapshotter = "lazyfork-snapshotter", "lazyfork"
		hopts.Runtimes = append(hopts.Runtimes, sn)
		o.handlers = append(o.handlers, sn.Name)
	}
	c, err := harness.Start(ctx, hopts)
	if err != nil {
		return 0, err
	}
	defer func() {
		if o.keep {
			fmt.Fprintf(os.Stderr, "lfh-critest: kept %s, containerd running (lfh-reap %s)\n", c.Dir, c.Dir)
			return
		}
		if err := c.Stop(); err != nil {
			fmt.Fprintf(os.Stderr, "lfh-critest: stop containerd: %v\n", err)
		}
	}()
	if _, err := c.ImportCRIImages(ctx, "", "pause"); err != nil {
		return 0, err
	}
	nw, err := c.AddBridgeNetworkWithPorts(ctx)
	if err != nil {
		return 0, err
	}
	defer func() {
		if err := nw.Remove(); err != nil {
			fmt.Fprintln(os.Stderr, "lfh-critest:", err)
		}
	}()
	fmt.Printf("critest: containerd %s, registry %s, stand-ins ready in %.1fs; logs in %s\n", c.Dir, reg.Host, time.Since(t0).Seconds(), o.out)

	results := map[string]map[string]string{} // handler -> spec -> status
	for _, h := range o.handlers {
		t := time.Now()
		res, err := runCritest(ctx, o, c.Address, h)
		if err != nil {
			return 0, fmt.Errorf("critest under %s: %w", h, err)
		}
		results[h] = res
		p, f, s := counts(res)
		fmt.Printf("critest: handler %-9s %3d passed %3d failed %3d skipped  (%.0fs)\n", h, p, f, s, time.Since(t).Seconds())
	}
	return report(os.Stdout, o.handlers, results), nil
}

// startSnapshotter runs lazyfork-snapshotter under dir, serving (and
// collecting the memory of) the stack's LazyFork root lfRoot, until stop.
func startSnapshotter(bin, dir, lfRoot string) (root, address string, stop func(), _ error) {
	root, address = filepath.Join(dir, "snapshotter"), filepath.Join(dir, "sn.sock")
	logf, err := os.Create(filepath.Join(dir, "snapshotter.log"))
	if err != nil {
		return "", "", nil, err
	}
	defer logf.Close()
	cmd := exec.Command(filepath.Join(bin, "lazyfork-snapshotter"), "--root", root, "--address", address, "--lazyfork-root", lfRoot)
	cmd.Stdout, cmd.Stderr = logf, logf
	if err := cmd.Start(); err != nil {
		return "", "", nil, err
	}
	done := make(chan struct{})
	go func() { _ = cmd.Wait(); close(done) }()
	stop = func() {
		_ = cmd.Process.Signal(syscall.SIGTERM)
		select {
		case <-done:
		case <-time.After(30 * time.Second):
			_ = cmd.Process.Kill()
			<-done
		}
		if mounts, _ := harness.MountsUnder(root); len(mounts) > 0 {
			for _, m := range mounts {
				_ = syscall.Unmount(m, syscall.MNT_DETACH)
			}
		}
	}
	for deadline := time.Now().Add(30 * time.Second); ; {
		if _, err := os.Stat(address); err == nil {
			return root, address, stop, nil
		}
		select {
		case <-done:
			return "", "", nil, fmt.Errorf("lazyfork-snapshotter exited (log %s)", logf.Name())
		case <-time.After(50 * time.Millisecond):
		}
		if time.Now().After(deadline) {
			stop()
			return "", "", nil, fmt.Errorf("lazyfork-snapshotter not serving %s after 30 s", address)
		}
	}
}

// buildNNP builds the nonewprivs stand-in's program, static, and returns it.
func buildNNP(ctx context.Context, dir string) (string, error) {
	repo, err := harness.RepoRoot()
	if err != nil {
		return "", err
	}
	out := filepath.Join(dir, "nnp")
	cmd := exec.CommandContext(ctx, "go", "build", "-o", out, "./integration/harness/cmd/lfh-critest/nnp")
	cmd.Dir = repo
	cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
	if b, err := cmd.CombinedOutput(); err != nil {
		return "", fmt.Errorf("build the nonewprivs stand-in: %v: %s", err, b)
	}
	b, err := os.ReadFile(out)
	return string(b), err
}

// runCritest runs the suite under one handler and reads its JUnit report.
func runCritest(ctx context.Context, o options, address, handler string) (map[string]string, error) {
	junit := filepath.Join(o.out, handler+".xml")
	logPath := filepath.Join(o.out, handler+".log")
	logf, err := os.Create(logPath)
	if err != nil {
		return nil, err
	}
	defer logf.Close()
	args := []string{
		"-runtime-endpoint", "unix://" + address,
		"-image-endpoint", "unix://" + address,
		"-runtime-handler", handler,
		"-ginkgo.junit-report", junit,
		"-ginkgo.no-color",
	}
	if o.skip != "" {
		args = append(args, "-ginkgo.skip", o.skip)
	}
	if o.focus != "" {
		args = append(args, "-ginkgo.focus", o.focus)
	}
	cmd := exec.CommandContext(ctx, o.critest, args...)
	cmd.Stdout, cmd.Stderr = logf, logf
	cmd.Dir = o.out
	runErr := cmd.Run()
	res, err := readJUnit(junit)
	if err != nil {
		return nil, fmt.Errorf("%v (critest: %v; log %s)", err, runErr, logPath)
	}
	var exit *exec.ExitError
	if runErr != nil && !errors.As(runErr, &exit) {
		return nil, runErr
	}
	return res, nil
}

type junitSuites struct {
	Suites []struct {
		Cases []struct {
			Name   string `xml:"name,attr"`
			Status string `xml:"status,attr"`
		} `xml:"testcase"`
	} `xml:"testsuite"`
}

// readJUnit returns spec name -> passed/failed/skipped of a ginkgo JUnit
// report (only the It nodes: not the suite's setup entries).
func readJUnit(path string) (map[string]string, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return nil, err
	}
	var s junitSuites
	if err := xml.Unmarshal(b, &s); err != nil {
		return nil, fmt.Errorf("%s: %w", path, err)
	}
	res := map[string]string{}
	for _, su := range s.Suites {
		for _, c := range su.Cases {
			if !strings.HasPrefix(c.Name, "[It] ") {
				continue
			}
			st := c.Status
			switch st {
			case "passed", "failed", "skipped":
			case "pending":
				st = "skipped"
			default: // panicked, interrupted, timedout
				st = "failed"
			}
			res[strings.TrimPrefix(c.Name, "[It] ")] = st
		}
	}
	if len(res) == 0 {
		return nil, fmt.Errorf("%s: no specs", path)
	}
	return res, nil
}

func counts(res map[string]string) (passed, failed, skipped int) {
	for _, st := range res {
		switch st {
		case "passed":
			passed++
		case "failed":
			failed++
		default:
			skipped++
		}
	}
	return
}

// report prints the specs whose results differ between handlers and those
// failing everywhere; it returns 1 when a handler other than the first fails
// a spec the first passes.
func report(w io.Writer, handlers []string, results map[string]map[string]string) int {
	code := 0
	specs := map[string]bool{}
	for _, r := range results {
		for s := range r {
			specs[s] = true
		}
	}
	var names []string
	for s := range specs {
		names = append(names, s)
	}
	sort.Strings(names)
	fmt.Fprintf(w, "\n%-8s", "")
	for _, h := range handlers {
		fmt.Fprintf(w, " %-9s", h)
	}
	fmt.Fprintln(w, " spec (only those not passed everywhere)")
	for _, s := range names {
		all := true
		var row strings.Builder
		for i, h := range handlers {
			st := results[h][s]
			if st == "" {
				st = "-"
			}
			if st != "passed" {
				all = false
			}
			if i > 0 && results[handlers[0]][s] == "passed" && st == "failed" {
				code = 1
			}
			fmt.Fprintf(&row, " %-9s", st)
		}
		if !all {
			fmt.Fprintf(w, "%-8s%s %s\n", "", row.String(), s)
		}
	}
	fmt.Fprintf(w, "\n%-8s", "total")
	for _, h := range handlers {
		p, f, s := counts(results[h])
		fmt.Fprintf(w, " %d/%d/%d", p, f, s)
	}
	fmt.Fprintln(w, "  (passed/failed/skipped)")
	if code != 0 {
		fmt.Fprintf(w, "FAIL: a handler fails a spec %s passes\n", handlers[0])
	}
	return code
}
