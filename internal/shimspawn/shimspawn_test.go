package shimspawn

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"reflect"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	bootapi "github.com/containerd/containerd/api/runtime/bootstrap/v1"
	"github.com/containerd/containerd/v2/cmd/containerd-shim-runc-v2/manager"
	"github.com/containerd/containerd/v2/pkg/namespaces"
	"github.com/containerd/containerd/v2/pkg/shim"
	"golang.org/x/sys/unix"

	"github.com/lazyfork/lazyfork/internal/shimaddr"
	"github.com/lazyfork/lazyfork/internal/testutil"
)

// recordEnv makes the test binary, run as a shim daemon, record what it
// got (a daemonRecord) in the directory it names, then wait for the file
// "go" there and exit.
const recordEnv = "SHIMSPAWN_TEST_RECORD"

func TestMain(m *testing.M) {
	if dir := os.Getenv(recordEnv); dir != "" && len(os.Args) > 1 && os.Args[1] == "-namespace" {
		record(dir)
		return
	}
	os.Exit(m.Run())
}

// daemonRecord is what a shim daemon gets from the start that ran it.
type daemonRecord struct {
	Pid      int
	Args     []string
	Env      []string
	Cwd      string
	OwnGroup bool              // its own process group
	Fds      map[string]string // descriptor: target kind and flags
	Sockets  map[string]string // descriptor: bound path, listening
}

func record(dir string) {
	r := daemonRecord{Pid: os.Getpid(), Args: os.Args, Env: os.Environ(), Fds: map[string]string{}, Sockets: map[string]string{}}
	r.Cwd, _ = os.Getwd()
	r.OwnGroup = syscall.Getpgrp() == os.Getpid()
	fds, _ := os.ReadDir("/proc/self/fd")
	for _, e := range fds {
		fd, _ := strconv.Atoi(e.Name())
		target, err := os.Readlink("/proc/self/fd/" + e.Name())
		if err != nil { // the directory's own descriptor, closed
			continue
		}
		if fd > 4 || strings.HasPrefix(target, "/sys/fs/cgroup/") {
			continue // the recorder's own, the Go runtime's (its CPU limit)
		}
		if strings.HasPrefix(target, "socket:") {
			target = "socket"
			sa, _ := unix.Getsockname(fd)
			acc, _ := unix.GetsockoptInt(fd, unix.SOL_SOCKET, unix.SO_ACCEPTCONN)
			typ, _ := unix.GetsockoptInt(fd, unix.SOL_SOCKET, unix.SO_TYPE)
			if u, ok := sa.(*unix.SockaddrUnix); ok {
				r.Sockets[e.Name()] = fmt.Sprintf("%s listening=%d type=%d", u.Name, acc, typ)
			}
		}
		info, _ := os.ReadFile("/proc/self/fdinfo/" + e.Name())
		flags := ""
		for _, l := range strings.Split(string(info), "\n") {
			if v, ok := strings.CutPrefix(l, "flags:"); ok {
				flags = strings.TrimSpace(v)
			}
		}
		r.Fds[e.Name()] = target + " flags=" + flags
	}
	b, _ := json.Marshal(r)
	os.WriteFile(filepath.Join(dir, fmt.Sprintf("record-%d.json", r.Pid)), b, 0o600)
	for range 6000 {
		if _, err := os.Stat(filepath.Join(dir, "go")); err == nil {
			return
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// waitRecord waits for the record of a daemon (pid 0: any) in dir.
func waitRecord(t *testing.T, dir string, pid int) daemonRecord {
	t.Helper()
	for range 3000 {
		ms, _ := filepath.Glob(filepath.Join(dir, "record-*.json"))
		for _, m := range ms {
			var r daemonRecord
			if b, err := os.ReadFile(m); err == nil && json.Unmarshal(b, &r) == nil && (pid == 0 || r.Pid == pid) {
				return r
			}
		}
		time.Sleep(10 * time.Millisecond)
	}
	t.Fatalf("no shim daemon recorded in %s", dir)
	return daemonRecord{}
}

// started is one start, by runc's manager or by Spawn.
type started struct {
	address  string
	daemon   daemonRecord
	oomScore string
	sockets  []string // the socket files: mode
}

type fixture struct {
	bundle, recDir string
	params         *bootapi.BootstrapParams
	grouping       string
}

func newFixture(t *testing.T, ann map[string]string, level bootapi.LogLevel) *fixture {
	f := &fixture{bundle: t.TempDir(), recDir: t.TempDir()}
	spec := map[string]any{"ociVersion": "1.2.0", "annotations": ann}
	b, _ := json.Marshal(spec)
	if err := os.WriteFile(filepath.Join(f.bundle, "config.json"), b, 0o600); err != nil {
		t.Fatal(err)
	}
	f.params = &bootapi.BootstrapParams{
		InstanceID:             "ctr-1",
		Namespace:              "lf-test",
		LogLevel:               level,
		ContainerdVersion:      "v2.4.2",
		ContainerdGrpcAddress:  "/tmp/lfh-x/containerd.sock",
		ContainerdTtrpcAddress: "/tmp/lfh-x/containerd.sock.ttrpc",
		ContainerdBinary:       "/usr/local/bin/containerd",
	}
	f.grouping = shimaddr.Grouping("ctr-1", ann)
	t.Chdir(f.bundle)
	t.Setenv(recordEnv, f.recDir)
	t.Setenv("GOMAXPROCS", "2") // containerd's, for `start`
	return f
}

// socketDir is a fresh socket directory, short (a socket path has at most
// 107 bytes).
func socketDir(t *testing.T) string {
	d, err := os.MkdirTemp("", "lfsp-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(d) })
	return filepath.Join(d, "s")
}

// runcStart starts the daemon with containerd's runc manager.
func (f *fixture) runcStart(t *testing.T, dir string) started {
	t.Helper()
	p := f.params
	p.SocketDir = &dir
	ctx := namespaces.WithNamespace(context.Background(), p.Namespace)
	res, err := manager.NewShimManager("io.containerd.runc.v2").Start(ctx, p)
	if err != nil {
		t.Fatalf("runc's manager: %v", err)
	}
	if res.Version != 3 || res.Protocol != "ttrpc" {
		t.Errorf("runc's manager's result %v: want version 3, ttrpc (the front's encodeResult)", res)
	}
	return f.collect(t, dir, res.Address, 0)
}

// spawnStart starts the daemon with Spawn.
func (f *fixture) spawnStart(t *testing.T, dir string) started {
	t.Helper()
	self, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	p := Params{ID: f.params.InstanceID, Namespace: f.params.Namespace, GRPCAddress: f.params.ContainerdGrpcAddress, SocketDir: dir, Debug: f.params.LogLevel <= bootapi.LogLevel_LOG_LEVEL_DEBUG}
	s, err := Spawn(self, p, f.grouping)
	if err != nil {
		t.Fatalf("Spawn: %v", err)
	}
	if s.Running || s.Pid == 0 {
		t.Fatalf("Spawn %+v: want a daemon started", s)
	}
	return f.collect(t, dir, s.Address, s.Pid)
}

func (f *fixture) collect(t *testing.T, dir, address string, pid int) started {
	t.Helper()
	s := started{address: address, daemon: waitRecord(t, f.recDir, pid)}
	oom, err := os.ReadFile(fmt.Sprintf("/proc/%d/oom_score_adj", s.daemon.Pid))
	if err != nil {
		t.Fatal(err)
	}
	s.oomScore = string(oom)
	ents, _ := os.ReadDir(dir)
	for _, e := range ents {
		fi, err := os.Lstat(filepath.Join(dir, e.Name()))
		if err != nil {
			t.Fatal(err)
		}
		s.sockets = append(s.sockets, fi.Mode().String())
	}
	if fi, err := os.Stat(dir); err == nil {
		s.sockets = append(s.sockets, "dir "+fi.Mode().String())
	}
	if err := os.WriteFile(filepath.Join(f.recDir, "go"), nil, 0o600); err != nil {
		t.Fatal(err)
	}
	// Wait for the daemon to go (runc's manager reaps its own).
	for range 3000 {
		if err := syscall.Kill(s.daemon.Pid, 0); err != nil {
			break
		}
		if pid != 0 {
			var ws syscall.WaitStatus
			syscall.Wait4(pid, &ws, syscall.WNOHANG, nil)
		}
		time.Sleep(10 * time.Millisecond)
	}
	os.Remove(filepath.Join(f.recDir, "go"))
	ms, _ := filepath.Glob(filepath.Join(f.recDir, "record-*"))
	for _, m := range ms {
		os.Remove(m)
	}
	return s
}

// normalise makes two starts into different socket directories comparable.
func (s started) normalise(dir string) started {
	s.address = strings.ReplaceAll(s.address, dir, "$DIR")
	for k, v := range s.daemon.Sockets {
		s.daemon.Sockets[k] = strings.ReplaceAll(v, dir, "$DIR")
	}
	s.daemon.Pid = 0
	return s
}

// Spawn starts the daemon runc's manager starts for the same start: the
// same command line, environment, directory, process group, descriptors
// (the listening socket as 3, the debug one as 4 at debug level, /dev/null
// for the standard ones, each with the same flags), the same socket files
// and OOM score, and answers the same address.
func TestSpawnIsRuncsStart(t *testing.T) {
	testutil.RequiresRoot(t) // the OOM score write
	for _, tc := range []struct {
		name  string
		ann   map[string]string
		level bootapi.LogLevel
	}{
		{"own shim", nil, bootapi.LogLevel_LOG_LEVEL_INFO},
		{"debug", nil, bootapi.LogLevel_LOG_LEVEL_DEBUG},
		{"trace, group", map[string]string{shimaddr.AnnotationRuncGroup: "lazyfork-group-b-0"}, bootapi.LogLevel_LOG_LEVEL_TRACE},
		{"pod", map[string]string{shimaddr.AnnotationCRISandbox: "pod1"}, bootapi.LogLevel_LOG_LEVEL_WARN},
	} {
		t.Run(tc.name, func(t *testing.T) {
			f := newFixture(t, tc.ann, tc.level)
			rdir, sdir := socketDir(t), socketDir(t)
			runc := f.runcStart(t, rdir).normalise(rdir)
			spawned := f.spawnStart(t, sdir).normalise(sdir)
			if !reflect.DeepEqual(runc, spawned) {
				t.Errorf("runc's manager started\n%+v\nSpawn\n%+v", runc, spawned)
			}
			wantFds := 3
			if tc.level <= bootapi.LogLevel_LOG_LEVEL_DEBUG {
				wantFds = 4
			}
			if len(spawned.daemon.Sockets) != wantFds-2 || len(spawned.daemon.Fds) != wantFds+1 {
				t.Errorf("daemon got descriptors %v, sockets %v", spawned.daemon.Fds, spawned.daemon.Sockets)
			}
		})
	}
}

// Where a shim serves the group's socket, Spawn answers its address and
// starts nothing; a stale socket (nothing listening) is replaced, as runc's
// manager replaces it.
func TestSpawnRunningAndStale(t *testing.T) {
	testutil.RequiresRoot(t)
	f := newFixture(t, map[string]string{shimaddr.AnnotationRuncGroup: "g"}, bootapi.LogLevel_LOG_LEVEL_INFO)
	dir := socketDir(t)
	addr := shimaddr.Address(dir, f.params.ContainerdGrpcAddress, f.params.Namespace, "g", false)
	path := strings.TrimPrefix(addr, "unix://")
	if err := os.MkdirAll(dir, 0o700); err != nil {
		t.Fatal(err)
	}
	l, err := net.Listen("unix", path)
	if err != nil {
		t.Fatal(err)
	}
	p := Params{ID: "ctr-1", Namespace: f.params.Namespace, GRPCAddress: f.params.ContainerdGrpcAddress, SocketDir: dir}
	s, err := Spawn("/nonexistent", p, "g")
	if err != nil || !s.Running || s.Address != addr {
		t.Fatalf("a shim serves %s: Spawn %+v %v, want its address, running", addr, s, err)
	}
	// runc's answer for the same.
	ctx := namespaces.WithNamespace(context.Background(), p.Namespace)
	f.params.SocketDir = &dir
	res, err := manager.NewShimManager("x").Start(ctx, f.params)
	if err != nil || res.Address != addr {
		t.Fatalf("runc's manager: %v %v, want %s", res, err, addr)
	}

	// Stale: the socket file stays, nothing listens.
	l.(*net.UnixListener).SetUnlinkOnClose(false)
	l.Close()
	if shim.CanConnect(addr) || CanConnect(addr) {
		t.Fatal("a closed socket accepts connections")
	}
	self, _ := os.Executable()
	s, err = Spawn(self, p, "g")
	if err != nil || s.Running || s.Address != addr {
		t.Fatalf("stale socket: Spawn %+v %v, want a new shim at %s", s, err, addr)
	}
	f.collect(t, dir, s.Address, s.Pid)
	if !CanConnect(addr) {
		t.Error("the replaced socket does not listen")
	}
}

// A start that cannot run the daemon leaves no socket and no daemon, and
// says so as an error that is not an Error (the front then hands the start
// to the full shim).
func TestSpawnFailsCleanly(t *testing.T) {
	f := newFixture(t, nil, bootapi.LogLevel_LOG_LEVEL_DEBUG)
	dir := socketDir(t)
	p := Params{ID: "ctr-1", Namespace: f.params.Namespace, GRPCAddress: f.params.ContainerdGrpcAddress, SocketDir: dir, Debug: true}
	_, err := Spawn(filepath.Join(t.TempDir(), "missing"), p, "ctr-1")
	var after *Error
	if err == nil || errors.As(err, &after) {
		t.Fatalf("Spawn of a missing binary: %v, want an error before any daemon", err)
	}
	if ents, _ := os.ReadDir(dir); len(ents) != 0 {
		t.Errorf("sockets left: %v", ents)
	}
	p.Namespace = "bad/ns"
	if _, err := Spawn("/bin/true", p, "ctr-1"); err == nil {
		t.Error("Spawn took namespace bad/ns, which containerd's NamespaceRequired rejects")
	}
}

// The daemon's environment is the start's with runc's two additions,
// GOMAXPROCS replaced where containerd set it.
func TestCommandEnvironment(t *testing.T) {
	t.Setenv("GOMAXPROCS", "2")
	cmd, err := Command("/x/shim", "ns", "c1", "/run/c.sock", false)
	if err != nil {
		t.Fatal(err)
	}
	env := cmd.Environ()
	if !slices.Contains(env, "GOMAXPROCS=4") || slices.Contains(env, "GOMAXPROCS=2") || !slices.Contains(env, "OTEL_SERVICE_NAME=containerd-shim-c1") {
		t.Errorf("environment %v", env)
	}
	if want := []string{"/x/shim", "-namespace", "ns", "-id", "c1", "-address", "/run/c.sock"}; !slices.Equal(cmd.Args, want) {
		t.Errorf("args %q, want %q", cmd.Args, want)
	}
}
