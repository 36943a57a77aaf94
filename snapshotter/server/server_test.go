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

	"github.com/lazyfork/lazyfork/internal/testutil"
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

// SIGINT's Stop(false) cancels a freeze in flight: the call fails, its
// partial copy is gone when Stop returns, and a restart finds no trace.
func TestStopCancelsFreeze(t *testing.T) {
	testutil.Integration(t) // writes 1 GiB
	ctx := context.Background()
	sockDir, err := os.MkdirTemp("", "lfsn-srv-")
	if err != nil {
		t.Fatal(err)
	}
	defer os.RemoveAll(sockDir)
	cfg := DefaultConfig()
	cfg.Root = t.TempDir()
	cfg.Address = filepath.Join(sockDir, "s.sock")
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
