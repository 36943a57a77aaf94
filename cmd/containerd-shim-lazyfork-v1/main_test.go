package main

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"math/rand/v2"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	bootapi "github.com/containerd/containerd/api/runtime/bootstrap/v1"
	taskAPI "github.com/containerd/containerd/api/runtime/task/v3"
	"github.com/containerd/containerd/api/types/runc/options"
	"github.com/containerd/containerd/v2/pkg/namespaces"
	"github.com/containerd/containerd/v2/pkg/protobuf/proto"
	"github.com/containerd/containerd/v2/pkg/shim"
	"golang.org/x/sys/unix"
	"google.golang.org/protobuf/types/known/timestamppb"

	"github.com/lazyfork/lazyfork/api"
	"github.com/lazyfork/lazyfork/internal/shimaddr"
	"github.com/lazyfork/lazyfork/internal/testutil"
	"github.com/lazyfork/lazyfork/memfile/madvguard"
	lfshim "github.com/lazyfork/lazyfork/shim"
)

func TestNamesMatchTheirOwners(t *testing.T) {
	if madvguardServeEnv != madvguard.ServeEnv {
		t.Errorf("madvguardServeEnv %q, madvguard's %q", madvguardServeEnv, madvguard.ServeEnv)
	}
	if runtimeName != api.RuntimeName {
		t.Errorf("runtimeName %q, api's %q", runtimeName, api.RuntimeName)
	}
	if (&options.Options{}).ProtoReflect().Descriptor().FullName() != runcOptionsType {
		t.Errorf("runcOptionsType %q, containerd's %q", runcOptionsType, (&options.Options{}).ProtoReflect().Descriptor().FullName())
	}
	if logLevelDebug != int32(bootapi.LogLevel_LOG_LEVEL_DEBUG) {
		t.Errorf("logLevelDebug %d, containerd's %d", logLevelDebug, bootapi.LogLevel_LOG_LEVEL_DEBUG)
	}
}

// bootstrapParams are the parameters containerd 2.4 writes to `start`'s
// standard input (core/runtime/v2 command).
func bootstrapParams(t testing.TB, id, ns, socketDir string) *bootapi.BootstrapParams {
	p := &bootapi.BootstrapParams{
		InstanceID:             id,
		Namespace:              ns,
		LogLevel:               bootapi.LogLevel_LOG_LEVEL_DEBUG,
		ContainerdVersion:      "v2.4.2",
		ContainerdGrpcAddress:  "/tmp/lfh-1/containerd.sock",
		ContainerdTtrpcAddress: "/tmp/lfh-1/containerd.sock.ttrpc",
		ContainerdBinary:       "/usr/local/bin/containerd",
	}
	if socketDir != "" {
		p.SocketDir = &socketDir
	}
	if err := p.AddExtension(&options.Options{BinaryName: "runc", Root: "/run/runc", ShimCgroup: "/x"}); err != nil {
		t.Fatal(err)
	}
	return p
}

// The front reads the parameters containerd's generated code writes, and
// rejects whatever that code rejects (then the full shim reads them).
func TestDecodeParamsIsContainerds(t *testing.T) {
	for _, dir := range []string{"", "/tmp/lfh-1/s"} {
		in, err := proto.Marshal(bootstrapParams(t, "fork-1", "default", dir))
		if err != nil {
			t.Fatal(err)
		}
		p, err := decodeParams(in)
		if err != nil {
			t.Fatal(err)
		}
		want := params{instanceID: "fork-1", namespace: "default", logLevel: logLevelDebug, grpcAddress: "/tmp/lfh-1/containerd.sock", socketDir: dir, shimCgroup: true}
		if p != want {
			t.Errorf("decoded %+v, want %+v", p, want)
		}
	}
	valid, _ := proto.Marshal(bootstrapParams(t, "fork-1", "default", "/s"))
	r := rand.New(rand.NewPCG(3, 4))
	for range 50000 {
		b := bytes.Clone(valid)
		for range 1 + r.IntN(3) {
			if len(b) == 0 {
				break
			}
			switch r.IntN(3) {
			case 0:
				b[r.IntN(len(b))] = byte(r.IntN(256))
			case 1:
				b = b[:r.IntN(len(b))]
			case 2:
				b[r.IntN(len(b))] ^= 0x80
			}
		}
		var full bootapi.BootstrapParams
		ferr := proto.Unmarshal(b, &full)
		p, err := decodeParams(b)
		switch {
		case ferr != nil && err == nil:
			t.Fatalf("% x: front decodes %+v, containerd rejects it: %v", b, p, ferr)
		case ferr == nil && err == nil:
			if p.instanceID != full.InstanceID || p.namespace != full.Namespace || p.grpcAddress != full.ContainerdGrpcAddress || p.socketDir != full.GetSocketDir() || p.logLevel != int32(full.LogLevel) {
				t.Fatalf("% x: front decodes %+v, containerd %v", b, p, &full)
			}
			if !p.shimCgroup {
				var o options.Options
				if found, err := full.FindExtension(&o); err != nil || (found && o.ShimCgroup != "") {
					t.Fatalf("% x: front finds no shim cgroup, runc's manager finds %q (%v)", b, o.ShimCgroup, err)
				}
			}
		}
	}
}

func TestEncodeResultIsContainerds(t *testing.T) {
	for _, addr := range []string{"unix:///run/containerd/s/" + strings.Repeat("ab", 32), "unix://" + strings.Repeat("/x", 100)} {
		want, err := proto.Marshal(&bootapi.BootstrapResult{Version: 3, Address: addr, Protocol: "ttrpc"})
		if err != nil {
			t.Fatal(err)
		}
		if got := encodeResult(addr); !bytes.Equal(got, want) {
			t.Errorf("encodeResult(%q) = % x, containerd's % x", addr, got, want)
		}
	}
}

func TestParseArgs(t *testing.T) {
	// containerd 2.4's command line for `start` (core/runtime/v2 command).
	a, ok := parseArgs([]string{"-namespace", "default", "-address", "/run/containerd/containerd.sock", "-publish-binary", "/usr/local/bin/containerd", "-id", "fork-1", "-debug", "start"})
	if want := (args{namespace: "default", id: "fork-1", address: "/run/containerd/containerd.sock", action: "start"}); !ok || a != want {
		t.Errorf("parsed %+v %v, want %+v", a, ok, want)
	}
	a, ok = parseArgs([]string{"--namespace=k8s.io", "-id=c", "-bundle", "/b", "delete"})
	if want := (args{namespace: "k8s.io", id: "c", action: "delete"}); !ok || a != want {
		t.Errorf("parsed %+v %v, want %+v", a, ok, want)
	}
	for _, argv := range [][]string{
		{"-v"}, {"-info", "-namespace", "x"}, {"-id", "c", "start"}, {"-namespace", "x", "-bogus", "start"}, {"-namespace"},
		{"lazyfork-hook", "overcommit", "f"}, {"-namespace", "x", "-debug=maybe", "start"},
	} {
		if a, ok := parseArgs(argv); ok && a.action == "start" {
			t.Errorf("%q: the front would serve %+v, want the full shim", argv, a)
		}
	}
}

// shimFixture is a bundle and a socket directory where a shim of the group
// of the bundle's spec may listen.
type shimFixture struct {
	bundle, socketDir string
	params            *bootapi.BootstrapParams
	input             []byte
	args              args
}

func newShimFixture(t testing.TB, ann map[string]string) *shimFixture {
	t.Helper()
	// A short socket directory: a unix socket path has at most 107 bytes.
	sd, err := os.MkdirTemp("", "lfs-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(sd) })
	f := &shimFixture{bundle: t.TempDir(), socketDir: sd}
	spec := map[string]any{"ociVersion": "1.2.0", "process": map[string]any{"args": []string{"sleep", "1"}}, "annotations": ann}
	b, _ := json.MarshalIndent(spec, "", "\t")
	if err := os.WriteFile(filepath.Join(f.bundle, shimaddr.SpecFile), b, 0o600); err != nil {
		t.Fatal(err)
	}
	f.params = bootstrapParams(t, "fork-2", "default", f.socketDir)
	f.params.LogLevel = bootapi.LogLevel_LOG_LEVEL_INFO
	f.input, _ = proto.Marshal(f.params)
	f.args = args{namespace: "default", id: "fork-2", address: f.params.ContainerdGrpcAddress, action: "start"}
	t.Chdir(f.bundle)
	return f
}

// listen makes a shim of grouping listen where containerd's pkg/shim puts it.
func (f *shimFixture) listen(t *testing.T, grouping string) {
	t.Helper()
	ctx := namespaces.WithNamespace(context.Background(), "default")
	addr, err := shim.CreateSocketAddress(ctx, f.socketDir, f.params.ContainerdGrpcAddress, grouping, false)
	if err != nil {
		t.Fatal(err)
	}
	l, err := net.Listen("unix", strings.TrimPrefix(addr, "unix://"))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { l.Close() })
}

func (f *shimFixture) spec(t *testing.T) []byte {
	b, err := os.ReadFile(filepath.Join(f.bundle, shimaddr.SpecFile))
	if err != nil {
		t.Fatal(err)
	}
	return b
}

// Where a batch's shim runs, the front answers `start` byte for byte as the
// full shim's manager (LazyFork's manager on runc's) does, and leaves the
// bundle as it leaves it; where it does not, the front answers nothing and
// changes nothing.
func TestStartAnswersAsTheFullShim(t *testing.T) {
	for _, tc := range []struct {
		name     string
		ann      map[string]string
		grouping string // the shim that runs
	}{
		{"batch", map[string]string{api.AnnotationShimGroup: "fam-snap-0", api.AnnotationFamily: "fam"}, shimaddr.GroupID("fam-snap-0")},
		{"long batch name", map[string]string{api.AnnotationShimGroup: strings.Repeat("f", 80) + "-0"}, shimaddr.GroupID(strings.Repeat("f", 80) + "-0")},
		{"pod", map[string]string{api.AnnotationShimGroup: "b", shimaddr.AnnotationCRISandbox: "pod1"}, "pod1"},
		{"runc group", map[string]string{shimaddr.AnnotationRuncGroup: "g"}, "g"},
		{"own shim", nil, "fork-2"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			f := newShimFixture(t, tc.ann)
			orig := f.spec(t)
			out, held, ok, _ := start(f.args, f.input, "")
			if ok {
				t.Fatalf("no shim runs, the front answered % x", out)
			}
			if wantHeld := tc.ann[api.AnnotationShimGroup] != "" && tc.ann[shimaddr.AnnotationCRISandbox] == ""; (held != nil) != wantHeld {
				t.Errorf("no shim runs: front holds the start lock %v, want %v", held != nil, wantHeld)
			}
			if held != nil {
				held.Release()
			}
			if !bytes.Equal(f.spec(t), orig) {
				t.Fatalf("no shim runs, the front rewrote the spec")
			}
			if _, err := os.Lstat(socketDirLink); err == nil {
				t.Fatalf("no shim runs, the front linked the socket dir")
			}

			f.listen(t, tc.grouping)
			front, _, ok, _ := start(f.args, f.input, "")
			if !ok {
				t.Fatal("the shim runs, the front left the start to the full shim")
			}
			frontSpec := f.spec(t)
			if link, err := os.Readlink(socketDirLink); err != nil || link != f.socketDir {
				t.Errorf("socket dir link %q %v, want %q", link, err, f.socketDir)
			}

			if err := os.WriteFile(filepath.Join(f.bundle, shimaddr.SpecFile), orig, 0o600); err != nil {
				t.Fatal(err)
			}
			ctx := namespaces.WithNamespace(context.Background(), "default")
			res, err := lfshim.NewManager(api.RuntimeName).Start(ctx, f.params)
			if err != nil {
				t.Fatal(err)
			}
			full, err := proto.Marshal(res)
			if err != nil {
				t.Fatal(err)
			}
			if !bytes.Equal(front, full) {
				t.Errorf("front answered % x, the full shim % x (%v)", front, full, res)
			}
			if fullSpec := f.spec(t); !bytes.Equal(frontSpec, fullSpec) {
				t.Errorf("front left the spec\n%s\nthe full shim\n%s", frontSpec, fullSpec)
			}
			if ents, _ := os.ReadDir(f.socketDir); len(ents) != 1 {
				t.Errorf("socket dir holds %v, want the shim's socket only", ents)
			}
		})
	}
}

// BenchmarkStartRunningShim times `start` of a fork whose batch's shim runs,
// as containerd runs it (a new process, the bootstrap parameters on stdin),
// answered by the front and by the full shim; and `-v`, which the front
// hands to the full shim (the extra exec every other command pays). It
// needs the built binaries: LAZYFORK_BIN=bin (make build).
func BenchmarkStartRunningShim(b *testing.B) {
	bin := os.Getenv("LAZYFORK_BIN")
	if bin == "" {
		b.Skip("LAZYFORK_BIN unset: make build, then LAZYFORK_BIN=$PWD/bin")
	}
	f := newShimFixture(b, map[string]string{api.AnnotationShimGroup: "fam-snap-0"})
	l, err := net.Listen("unix", strings.TrimPrefix(shimaddr.Address(f.socketDir, f.params.ContainerdGrpcAddress, "default", shimaddr.GroupID("fam-snap-0"), false), "unix://"))
	if err != nil {
		b.Fatal(err)
	}
	defer l.Close()
	go func() {
		for {
			c, err := l.Accept()
			if err != nil {
				return
			}
			c.Close()
		}
	}()
	want := encodeResult("unix://" + l.Addr().String())
	argv := []string{"-namespace", "default", "-address", f.params.ContainerdGrpcAddress, "-publish-binary", "/usr/local/bin/containerd", "-id", "fork-2", "start"}
	for _, name := range []string{"containerd-shim-lazyfork-v1", FullName} {
		b.Run("start/"+name, func(b *testing.B) {
			for b.Loop() {
				cmd := exec.Command(filepath.Join(bin, name), argv...)
				cmd.Dir = f.bundle
				cmd.Stdin = bytes.NewReader(f.input)
				out, err := cmd.Output()
				if err != nil || !bytes.Equal(out, want) {
					b.Fatalf("%s start: % x %v, want % x", name, out, err, want)
				}
			}
		})
	}
	for _, name := range []string{"containerd-shim-lazyfork-v1", FullName} {
		b.Run("version/"+name, func(b *testing.B) {
			for b.Loop() {
				if out, err := exec.Command(filepath.Join(bin, name), "-v").Output(); err != nil || !bytes.Contains(out, []byte("Version")) {
					b.Fatalf("%s -v: %s %v", name, out, err)
				}
			}
		})
	}
}

// A start the front leaves to the full shim keeps the group's start lock
// held across the exec, and the full shim's manager takes it over instead of
// waiting for it (which would wait forever), then frees it.
func TestHeldLockGoesToTheFullShim(t *testing.T) {
	f := newShimFixture(t, map[string]string{api.AnnotationShimGroup: "fam-snap-1"})
	_, held, ok, _ := start(f.args, f.input, "")
	if ok || held == nil {
		t.Fatalf("no shim runs: front answered %v, holds the lock %v; want neither answer nor release", ok, held != nil)
	}
	kv, err := held.Handoff()
	if err != nil {
		t.Fatal(err)
	}
	k, v, _ := strings.Cut(kv, "=")
	t.Setenv(k, v)
	// The shim the full shim would start (runc's manager would spawn it).
	f.listen(t, shimaddr.GroupID("fam-snap-1"))
	done := make(chan error, 1)
	go func() {
		ctx := namespaces.WithNamespace(context.Background(), "default")
		_, err := lfshim.NewManager(api.RuntimeName).Start(ctx, f.params)
		done <- err
	}()
	select {
	case err := <-done:
		if err != nil {
			t.Fatal(err)
		}
	case <-time.After(time.Minute):
		t.Fatal("the manager waits for the start lock the front handed it")
	}
	if _, still := os.LookupEnv(shimaddr.LockEnv); still {
		t.Errorf("%s left for the shim daemon to inherit", shimaddr.LockEnv)
	}
	lock, err := shimaddr.LockStart(f.socketDir, shimaddr.GroupID("fam-snap-1"))
	if err != nil {
		t.Fatal(err)
	}
	lock.Release()
}

// daemonEnv makes the test binary, run as a shim daemon (by the full shim's
// manager, which runs its own executable), exit at once.
const daemonEnv = "LAZYFORK_FRONT_TEST_DAEMON"

// frontEnv makes the test binary the front: main.
const frontEnv = "LAZYFORK_FRONT_TEST_MAIN"

func TestMain(m *testing.M) {
	if os.Getenv(daemonEnv) != "" && len(os.Args) > 1 && os.Args[1] == "-namespace" {
		return
	}
	if os.Getenv(frontEnv) != "" {
		main()
		return
	}
	os.Exit(m.Run())
}

// fakeFull is a full shim binary that records its arguments in the file it
// returns, and exits.
func fakeFull(t *testing.T) (full, argsFile string) {
	dir := t.TempDir()
	argsFile = filepath.Join(dir, "args")
	full = filepath.Join(dir, FullName)
	script := "#!/bin/sh\necho \"$@\" >" + argsFile + ".tmp && mv " + argsFile + ".tmp " + argsFile + "\n"
	if err := os.WriteFile(full, []byte(script), 0o755); err != nil {
		t.Fatal(err)
	}
	return full, argsFile
}

func waitFile(t *testing.T, path string) string {
	t.Helper()
	for range 3000 {
		if b, err := os.ReadFile(path); err == nil {
			return string(b)
		}
		time.Sleep(10 * time.Millisecond)
	}
	t.Fatalf("%s never written", path)
	return ""
}

// Where no shim of the container's group runs, the front starts the full
// binary as the group's shim daemon itself, and answers, rewrites the spec
// and links the socket directory as the full shim's `start` does; it frees
// the group's start lock, and the group's next start finds the new shim.
func TestStartSpawnsTheShim(t *testing.T) {
	testutil.RequiresRoot(t) // the OOM score, as containerd's code sets it
	for _, tc := range []struct {
		name     string
		ann      map[string]string
		grouping string
		level    bootapi.LogLevel
	}{
		{"batch", map[string]string{api.AnnotationShimGroup: "fam-snap-0", api.AnnotationFamily: "fam"}, shimaddr.GroupID("fam-snap-0"), bootapi.LogLevel_LOG_LEVEL_INFO},
		{"batch, debug", map[string]string{api.AnnotationShimGroup: "fam-snap-0"}, shimaddr.GroupID("fam-snap-0"), bootapi.LogLevel_LOG_LEVEL_DEBUG},
		{"pod", map[string]string{api.AnnotationShimGroup: "b", shimaddr.AnnotationCRISandbox: "pod1"}, "pod1", bootapi.LogLevel_LOG_LEVEL_INFO},
		{"own shim, trace", nil, "fork-2", bootapi.LogLevel_LOG_LEVEL_TRACE},
	} {
		t.Run(tc.name, func(t *testing.T) {
			f := newShimFixture(t, tc.ann)
			f.params.Extensions = nil
			if err := f.params.AddExtension(&options.Options{BinaryName: "runc", Root: "/run/runc", SystemdCgroup: true}); err != nil {
				t.Fatal(err)
			}
			f.params.LogLevel = tc.level
			f.input, _ = proto.Marshal(f.params)
			orig := f.spec(t)
			full, argsFile := fakeFull(t)

			out, held, ok, err := start(f.args, f.input, full)
			if err != nil || !ok || held != nil {
				t.Fatalf("no shim runs: front answered %v, holds the lock %v, %v; want it to start one", ok, held != nil, err)
			}
			want := "-namespace default -id fork-2 -address " + f.params.ContainerdGrpcAddress
			if tc.level <= bootapi.LogLevel_LOG_LEVEL_DEBUG {
				want += " -debug"
			}
			if got := strings.TrimSpace(waitFile(t, argsFile)); got != want {
				t.Errorf("the front ran the full shim with %q, want %q", got, want)
			}
			if locks, _ := filepath.Glob(filepath.Join(f.socketDir, ".lazyfork-start-*")); len(locks) != 0 {
				t.Errorf("start lock still held: %v", locks)
			}
			again, _, ok, err := start(f.args, f.input, full)
			if err != nil || !ok || !bytes.Equal(again, out) {
				t.Errorf("the group's next start: % x %v %v, want the new shim's % x", again, ok, err, out)
			}
			frontSpec := f.spec(t)
			if link, err := os.Readlink(socketDirLink); err != nil || link != f.socketDir {
				t.Errorf("socket dir link %q %v, want %q", link, err, f.socketDir)
			}

			// The full shim's `start`, from the same bundle and no shim.
			os.Remove(socketDirLink)
			ents, _ := os.ReadDir(f.socketDir)
			for _, e := range ents {
				os.Remove(filepath.Join(f.socketDir, e.Name()))
			}
			if err := os.WriteFile(filepath.Join(f.bundle, shimaddr.SpecFile), orig, 0o600); err != nil {
				t.Fatal(err)
			}
			t.Setenv(daemonEnv, "1")
			ctx := namespaces.WithNamespace(context.Background(), "default")
			res, err := lfshim.NewManager(api.RuntimeName).Start(ctx, f.params)
			if err != nil {
				t.Fatal(err)
			}
			fullOut, err := proto.Marshal(res)
			if err != nil {
				t.Fatal(err)
			}
			if !bytes.Equal(out, fullOut) {
				t.Errorf("front answered % x, the full shim % x (%v)", out, fullOut, res)
			}
			if fullSpec := f.spec(t); !bytes.Equal(frontSpec, fullSpec) {
				t.Errorf("front left the spec\n%s\nthe full shim\n%s", frontSpec, fullSpec)
			}
		})
	}
}

// A new shim the front cannot start exactly as runc's manager would (a
// shim cgroup to join, core scheduling) is the full shim's to start: the
// front starts nothing, writes nothing, and hands on the start lock.
func TestStartLeavesToTheFullShim(t *testing.T) {
	testutil.RequiresRoot(t)
	for _, tc := range []struct {
		name      string
		cgroup    string
		schedCore string
	}{{"shim cgroup", "/lf.slice", ""}, {"core scheduling", "", "1"}} {
		t.Run(tc.name, func(t *testing.T) {
			f := newShimFixture(t, map[string]string{api.AnnotationShimGroup: "fam-snap-0"})
			f.params.Extensions = nil
			if err := f.params.AddExtension(&options.Options{ShimCgroup: tc.cgroup}); err != nil {
				t.Fatal(err)
			}
			f.input, _ = proto.Marshal(f.params)
			t.Setenv("SCHED_CORE", tc.schedCore)
			orig := f.spec(t)
			full, argsFile := fakeFull(t)
			_, held, ok, err := start(f.args, f.input, full)
			if ok || err != nil || held == nil {
				t.Fatalf("front answered %v %v, holds the lock %v; want the start left to the full shim, with the lock", ok, err, held != nil)
			}
			held.Release()
			if _, err := os.Stat(argsFile); err == nil {
				t.Error("the front started a shim")
			}
			if !bytes.Equal(f.spec(t), orig) {
				t.Error("the front rewrote the spec")
			}
			if ents, _ := os.ReadDir(f.socketDir); len(ents) != 0 {
				t.Errorf("the front left %v in the socket directory", ents)
			}
		})
	}
}

// The front stays small: no containerd, grpc or protobuf package, and no
// package net (which brings cgo's runtime and resolver set-up).
func TestFrontLinksLittle(t *testing.T) {
	gobin, err := exec.LookPath("go")
	if err != nil {
		t.Skip("no go command")
	}
	out, err := exec.Command(gobin, "list", "-deps", ".").Output()
	if err != nil {
		t.Fatal(err)
	}
	for _, p := range strings.Fields(string(out)) {
		if p == "net" || p == "runtime/cgo" || strings.HasPrefix(p, "google.golang.org/") || strings.HasPrefix(p, "github.com/containerd/") {
			t.Errorf("the front links %s", p)
		}
	}
}

// Concurrent starts of one group's containers, each a front process as
// containerd runs it, start one shim: the first starts it holding the
// group's start lock, which it frees once the shim's socket listens; the
// others then find that shim and answer its address.
func TestConcurrentStartsOfAGroupStartOneShim(t *testing.T) {
	testutil.RequiresRoot(t)
	self, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	bin := t.TempDir()
	b, err := os.ReadFile(self)
	if err != nil {
		t.Fatal(err)
	}
	front := filepath.Join(bin, "containerd-shim-lazyfork-v1")
	if err := os.WriteFile(front, b, 0o755); err != nil {
		t.Fatal(err)
	}
	log := filepath.Join(bin, "full.log")
	// The daemon keeps its socket (descriptor 3) open until killed.
	script := "#!/bin/sh\necho \"$*\" >>" + log + "\ncase \"$*\" in *start) exit 1;; esac\nexec sleep 60\n"
	if err := os.WriteFile(filepath.Join(bin, FullName), []byte(script), 0o755); err != nil {
		t.Fatal(err)
	}
	// The daemons the fronts start, orphaned when they exit, become this
	// process's children: they can be counted, and are reaped.
	if err := unix.Prctl(unix.PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		for _, pid := range children(t) {
			syscall.Kill(pid, syscall.SIGKILL)
			var ws syscall.WaitStatus
			syscall.Wait4(pid, &ws, 0, nil)
		}
		unix.Prctl(unix.PR_SET_CHILD_SUBREAPER, 0, 0, 0, 0)
	})

	const n = 4
	f := newShimFixture(t, nil)
	ann := map[string]string{api.AnnotationShimGroup: "fam-snap-7"}
	var cmds []*exec.Cmd
	var outs []*bytes.Buffer
	for i := range n {
		id := fmt.Sprintf("fork-%d", i)
		bundle := filepath.Join(t.TempDir(), id)
		if err := os.MkdirAll(bundle, 0o700); err != nil {
			t.Fatal(err)
		}
		spec, _ := json.Marshal(map[string]any{"ociVersion": "1.2.0", "annotations": ann})
		if err := os.WriteFile(filepath.Join(bundle, shimaddr.SpecFile), spec, 0o600); err != nil {
			t.Fatal(err)
		}
		p := bootstrapParams(t, id, "default", f.socketDir)
		p.Extensions = nil
		in, _ := proto.Marshal(p)
		cmd := exec.Command(front, "-namespace", "default", "-address", p.ContainerdGrpcAddress, "-publish-binary", "/usr/local/bin/containerd", "-id", id, "start")
		cmd.Dir = bundle
		cmd.Env = append(os.Environ(), frontEnv+"=1")
		cmd.Stdin = bytes.NewReader(in)
		out := &bytes.Buffer{}
		cmd.Stdout, cmd.Stderr = out, os.Stderr
		cmds, outs = append(cmds, cmd), append(outs, out)
	}
	for _, c := range cmds {
		if err := c.Start(); err != nil {
			t.Fatal(err)
		}
	}
	for i, c := range cmds {
		if err := c.Wait(); err != nil {
			t.Errorf("start of fork-%d: %v", i, err)
		}
	}
	want := encodeResult(shimaddr.Address(f.socketDir, f.params.ContainerdGrpcAddress, "default", shimaddr.GroupID("fam-snap-7"), false))
	for i, out := range outs {
		if !bytes.Equal(out.Bytes(), want) {
			t.Errorf("start of fork-%d answered % x, want the group's shim % x", i, out.Bytes(), want)
		}
	}
	daemons := children(t)
	for _, pid := range daemons {
		// Logged once it runs sleep.
		for i := 0; i < 3000; i++ {
			if b, _ := os.ReadFile(fmt.Sprintf("/proc/%d/cmdline", pid)); bytes.HasPrefix(b, []byte("sleep\x00")) {
				break
			}
			time.Sleep(10 * time.Millisecond)
		}
	}
	lines, _ := os.ReadFile(log)
	if len(daemons) != 1 || strings.Count(string(lines), "\n") != 1 || strings.Contains(string(lines), " start\n") {
		t.Errorf("%d starts of one group started %d daemons and ran the full binary as:\n%s\nwant one shim daemon", n, len(daemons), lines)
	}
}

// children are the live (not zombie) processes whose parent is this one.
func children(t *testing.T) []int {
	ents, err := os.ReadDir("/proc")
	if err != nil {
		t.Fatal(err)
	}
	var out []int
	for _, e := range ents {
		pid, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
		if err != nil {
			continue
		}
		// pid (comm) state ppid ...
		f := strings.Fields(string(b[bytes.LastIndexByte(b, ')')+1:]))
		if len(f) > 1 && f[0] != "Z" && f[1] == strconv.Itoa(os.Getpid()) {
			out = append(out, pid)
		}
	}
	return out
}

// `delete` of a task the full shim's Delete RPC deleted is the front's: it
// prints the DeleteResponse recorded in the bundle, byte for byte, as the
// full shim's `delete` prints one, and runs no full shim. Without a record
// (or for an id containerd would not give) it is the full shim's.
func TestDeleteOfADeletedTask(t *testing.T) {
	tasks := t.TempDir()
	bundle := filepath.Join(tasks, "fork-1")
	if err := os.Mkdir(bundle, 0o700); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(bundle, shimaddr.SpecFile), []byte("{}"), 0o600); err != nil {
		t.Fatal(err)
	}
	resp, err := proto.Marshal(&taskAPI.DeleteResponse{Pid: 42, ExitStatus: 137, ExitedAt: timestamppb.Now()})
	if err != nil {
		t.Fatal(err)
	}
	argv := []string{"-namespace", "default", "-address", "/run/containerd/containerd.sock", "-publish-binary", "/usr/local/bin/containerd", "-id", "fork-1", "delete"}
	a, _ := parseArgs(argv)
	t.Chdir(bundle)
	if _, ok := deleted(a); ok {
		t.Fatal("no record: the front answered")
	}
	if err := shimaddr.WriteDeleted(bundle, resp); err != nil {
		t.Fatal(err)
	}
	if out, ok := deleted(a); !ok || !bytes.Equal(out, resp) {
		t.Fatalf("recorded: front answered % x (%v), want % x", out, ok, resp)
	}
	for _, id := range []string{"../fork-1", ""} {
		if _, ok := deleted(args{namespace: "default", id: id, action: "delete"}); ok {
			t.Errorf("id %q: the front answered", id)
		}
	}

	// As containerd runs it: a process in the bundle, the full shim absent.
	self, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(self, argv...)
	cmd.Dir = bundle
	cmd.Env = append(os.Environ(), frontEnv+"=1")
	out, err := cmd.Output()
	if err != nil || !bytes.Equal(out, resp) {
		t.Fatalf("front delete: % x (%v), want % x", out, err, resp)
	}
	var got taskAPI.DeleteResponse
	if err := proto.Unmarshal(out, &got); err != nil || got.Pid != 42 || got.ExitStatus != 137 {
		t.Errorf("containerd would read %v (%v), want pid 42, status 137", &got, err)
	}
	os.Remove(filepath.Join(bundle, shimaddr.DeletedFile))
	if out, err := cmd.Output(); err == nil {
		t.Errorf("no record and no full shim: the front answered % x", out)
	}
}
