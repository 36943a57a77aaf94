//go:build linux

package server

import (
	"bytes"
	"context"
	"errors"
	"net"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	snapshotsapi "github.com/containerd/containerd/api/services/snapshots/v1"
	"github.com/containerd/containerd/v2/core/snapshots"
	"github.com/containerd/containerd/v2/core/snapshots/proxy"
	"github.com/containerd/errdefs"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"

	"github.com/lazyfork/lazyfork/api"
	"github.com/lazyfork/lazyfork/internal/testutil"
	"github.com/lazyfork/lazyfork/memfile"
	"github.com/lazyfork/lazyfork/snapshotter"
)

func TestLoadConfig(t *testing.T) {
	dir := t.TempDir()
	p := filepath.Join(dir, "c.toml")
	if err := os.WriteFile(p, []byte("root = \"/x\"\nmount_options = [\"volatile\"]\nasync_remove = true\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	cfg, err := LoadConfig(p)
	if err != nil {
		t.Fatal(err)
	}
	if cfg.Root != "/x" || cfg.Address != DefaultConfig().Address || !cfg.AsyncRemove || len(cfg.MountOptions) != 1 {
		t.Errorf("config: %+v", cfg)
	}
	if got := cfg.ttrpcAddress(); got != cfg.Address+".ttrpc" {
		t.Errorf("ttrpc address %q", got)
	}

	if time.Duration(cfg.MemoryGCInterval) != DefaultMemoryGCInterval {
		t.Errorf("memory_gc_interval %v, want the default %v", time.Duration(cfg.MemoryGCInterval), DefaultMemoryGCInterval)
	}
	for text, want := range map[string]time.Duration{`"90s"`: 90 * time.Second, `"0"`: 0} {
		if err := os.WriteFile(p, []byte("memory_gc_interval = "+text+"\n"), 0o600); err != nil {
			t.Fatal(err)
		}
		if cfg, err := LoadConfig(p); err != nil || time.Duration(cfg.MemoryGCInterval) != want {
			t.Errorf("memory_gc_interval = %s: %v (%v), want %v", text, time.Duration(cfg.MemoryGCInterval), err, want)
		}
	}
	for _, bad := range []string{`"soon"`, `"-1s"`} {
		if err := os.WriteFile(p, []byte("memory_gc_interval = "+bad+"\n"), 0o600); err != nil {
			t.Fatal(err)
		}
		if _, err := LoadConfig(p); !errdefs.IsInvalidArgument(err) {
			t.Errorf("memory_gc_interval = %s: %v, want invalid argument", bad, err)
		}
	}
	// A bare number reads as nanoseconds: a busy loop, refused.
	if err := os.WriteFile(p, []byte("memory_gc_interval = 60\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	if cfg, err := LoadConfig(p); err != nil || !errdefs.IsInvalidArgument(cfg.Validate()) {
		t.Errorf("memory_gc_interval = 60: load %v, validate %v; want it refused", err, cfg.Validate())
	}

	if err := os.WriteFile(p, []byte("rooot = \"/typo\"\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	if _, err := LoadConfig(p); !errdefs.IsInvalidArgument(err) {
		t.Errorf("unknown key: %v, want invalid argument", err)
	}
	if _, err := LoadConfig(filepath.Join(dir, "missing.toml")); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("missing file: %v", err)
	}
}

func TestValidate(t *testing.T) {
	long := "/tmp/" + string(make([]byte, 120))
	for _, c := range []Config{
		{Address: "/a.sock"},
		{Root: "/r"},
		{Root: "/r", Address: "/a.sock", TTRPCAddress: "/a.sock"},
		{Root: "/r", Address: long},
		{Root: "/r", Address: "/a.sock", LazyForkRoot: "/l", MemoryGCInterval: -1},
	} {
		if err := c.Validate(); !errdefs.IsInvalidArgument(err) {
			t.Errorf("%+v: %v, want invalid argument", c, err)
		}
	}
	if err := DefaultConfig().Validate(); err != nil {
		t.Errorf("default config: %v", err)
	}
}

// A stale socket (its server died) is replaced; a live one is not stolen;
// a non-socket is never removed.
func TestListen(t *testing.T) {
	ctx := context.Background()
	dir := t.TempDir()
	addr := filepath.Join(dir, "run", "s.sock")

	live, err := listen(ctx, addr)
	if err != nil {
		t.Fatal(err)
	}
	if fi, err := os.Stat(filepath.Dir(addr)); err != nil || fi.Mode().Perm() != 0o700 {
		t.Errorf("socket dir mode %v %v, want 0700", fi.Mode().Perm(), err)
	}
	if _, err := listen(ctx, addr); !errdefs.IsAlreadyExists(err) {
		t.Errorf("second listen on a live socket: %v, want already exists", err)
	}
	// Leave the socket file behind, as a killed server does.
	live.(*net.UnixListener).SetUnlinkOnClose(false)
	live.Close()
	l, err := listen(ctx, addr)
	if err != nil {
		t.Fatalf("stale socket not replaced: %v", err)
	}
	l.Close()

	file := filepath.Join(dir, "file")
	if err := os.WriteFile(file, []byte("keep"), 0o600); err != nil {
		t.Fatal(err)
	}
	if _, err := listen(ctx, file); !errdefs.IsAlreadyExists(err) {
		t.Errorf("listen on a regular file: %v", err)
	}
	if b, _ := os.ReadFile(file); string(b) != "keep" {
		t.Error("a regular file was replaced")
	}
}

// testConfig is a server's configuration on roots of the test's own (never
// the host's LazyFork root, which the memory collection would walk), its
// sockets in a directory short enough for their paths.
func testConfig(t *testing.T) Config {
	t.Helper()
	sockDir, err := os.MkdirTemp("", "lfsn-srv-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(sockDir) })
	cfg := DefaultConfig()
	cfg.Root = t.TempDir()
	cfg.LazyForkRoot = t.TempDir()
	cfg.Address = filepath.Join(sockDir, "s.sock")
	return cfg
}

// SIGINT's Stop(false) cancels a freeze in flight: the call fails, its
// partial copy is gone when Stop returns, and a restart finds no trace.
func TestStopCancelsFreeze(t *testing.T) {
	testutil.Integration(t) // writes 1 GiB
	ctx := context.Background()
	cfg := testConfig(t)
	srv, err := New(ctx, cfg, "test")
	if err != nil {
		t.Fatal(err)
	}
	served := make(chan error, 1)
	go func() { served <- srv.Serve(ctx) }()
	defer srv.Stop(ctx, false)

	conn, err := grpc.NewClient("unix://"+cfg.Address, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	sn := proxy.NewSnapshotter(snapshotsapi.NewSnapshotsClient(conn), "lazyfork")
	if _, err := sn.Prepare(ctx, "base-x", ""); err != nil {
		t.Fatal(err)
	}
	if err := sn.Commit(ctx, "base", "base-x"); err != nil {
		t.Fatal(err)
	}
	ms, err := sn.Prepare(ctx, "ctr", "base")
	if err != nil {
		t.Fatal(err)
	}
	var upper string
	for _, o := range ms[0].Options {
		if v, ok := strings.CutPrefix(o, "upperdir="); ok {
			upper = v
		}
	}
	f, err := os.Create(filepath.Join(upper, "big"))
	if err != nil {
		t.Fatal(err)
	}
	block := bytes.Repeat([]byte{7}, 1<<20)
	for range 1024 {
		if _, err := f.Write(block); err != nil {
			t.Fatal(err)
		}
	}
	f.Close()

	errc := make(chan error, 1)
	go func() {
		_, err := sn.Prepare(ctx, "frz", "base", snapshots.WithLabels(map[string]string{snapshotter.FreezeSourceLabel: "ctr"}))
		errc <- err
	}()
	snapDir := filepath.Join(cfg.Root, "snapshots")
	for {
		if m, _ := filepath.Glob(filepath.Join(snapDir, "*", "fs.pre", "big")); len(m) > 0 {
			break
		}
		select {
		case err := <-errc:
			t.Fatalf("the freeze finished before it could be cancelled (%v): this machine copies 1 GiB too fast for the test", err)
		default:
		}
		time.Sleep(time.Millisecond)
	}
	srv.Stop(ctx, false)
	if err := <-errc; err == nil {
		t.Fatal("a freeze cancelled by Stop(false) succeeded")
	}
	if m, _ := filepath.Glob(filepath.Join(snapDir, "*", "fs.pre")); len(m) > 0 {
		t.Errorf("partial copies left after Stop: %v", m)
	}
	<-served

	s2, err := snapshotter.New(ctx, cfg.Root)
	if err != nil {
		t.Fatal(err)
	}
	defer s2.Close()
	if _, err := s2.Stat(ctx, "frz"); !errdefs.IsNotFound(err) {
		t.Errorf("cancelled freeze recorded: %v", err)
	}
	if _, err := s2.Stat(ctx, "ctr"); err != nil {
		t.Errorf("the source went: %v", err)
	}
}

// The server collects LazyFork's memory store on its own: a file a task's
// reference holds stays while the task's bundle does, and is freed, with the
// reference and the task's view, once containerd removed the bundle without
// the shim's delete (as when a shim dies creating the task). Nobody calls
// lazyfork gc here.
func TestMemoryCollection(t *testing.T) {
	ctx := context.Background()
	cfg := testConfig(t)
	cfg.MemoryGCInterval = Duration(20 * time.Millisecond)

	memRoot := api.Root(cfg.LazyForkRoot).Mem()
	t.Cleanup(func() { memfile.RemoveAll(memRoot) })
	store, err := memfile.OpenStore(memRoot)
	if err != nil {
		t.Fatal(err)
	}
	pf, err := store.CreateFile("fam")
	if err != nil {
		t.Fatal(err)
	}
	if _, err := pf.File().WriteAt([]byte("heap"), 1<<20); err != nil {
		t.Fatal(err)
	}
	// Published for a snapshot that is gone: only the task's reference holds it.
	if err := pf.Publish(memfile.HolderSnapshot + "/nowhere"); err != nil {
		t.Fatal(err)
	}
	file := filepath.Join(memRoot, "fam", pf.Name())
	holder := memfile.HolderContainer + "ns/c1"
	bundle := filepath.Join(t.TempDir(), "io.containerd.runtime.v2.task", "ns", "c1")
	if err := os.MkdirAll(bundle, 0o700); err != nil {
		t.Fatal(err)
	}
	if err := store.RefBundle("fam", holder, bundle, []string{pf.Name()}); err != nil {
		t.Fatal(err)
	}
	view := memfile.ViewName("ns", "c1")
	if _, err := store.LinkView("fam", view, []string{pf.Name()}); err != nil {
		t.Fatal(err)
	}

	srv, err := New(ctx, cfg, "test")
	if err != nil {
		t.Fatal(err)
	}
	served := make(chan error, 1)
	go func() { served <- srv.Serve(ctx) }()
	defer func() {
		srv.Stop(ctx, true)
		if err := <-served; err != nil {
			t.Errorf("serve: %v", err)
		}
	}()

	exists := func(p string) bool { _, err := os.Lstat(p); return err == nil }
	time.Sleep(25 * time.Duration(cfg.MemoryGCInterval))
	if !exists(file) || !exists(store.ViewDir(view)) {
		t.Fatalf("collected while the task's bundle is there: file %v, view %v", exists(file), exists(store.ViewDir(view)))
	}
	if err := os.RemoveAll(bundle); err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(10 * time.Second)
	for exists(file) || exists(store.ViewDir(view)) {
		if time.Now().After(deadline) {
			t.Fatalf("10 s after the bundle went: file %v, view %v; want both collected", exists(file), exists(store.ViewDir(view)))
		}
		time.Sleep(10 * time.Millisecond)
	}
	if h, err := store.Holders("fam"); err == nil && len(h) != 0 {
		t.Errorf("holders %v after the collection, want none", h)
	}
}
