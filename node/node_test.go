package node

import (
	"bytes"
	"context"
	"errors"
	"io"
	"net"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/containerd/errdefs"
	"github.com/containerd/ttrpc"

	"github.com/lazyfork/lazyfork/api"
	pb "github.com/lazyfork/lazyfork/proto/lazyfork/v1"
)

// serve serves a Local on root over ttrpc and returns a Remote of it.
func serve(t *testing.T, root string) *Remote {
	t.Helper()
	sock := filepath.Join(t.TempDir(), "api.sock")
	l, err := net.Listen("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	srv, err := ttrpc.NewServer()
	if err != nil {
		t.Fatal(err)
	}
	pb.RegisterNodeService(srv, &Service{N: NewLocal(root)})
	go srv.Serve(context.Background(), l)
	t.Cleanup(func() { srv.Close() })
	r := NewRemote(sock)
	t.Cleanup(func() { r.Close() })
	return r
}

// A lock held through the API is seen by a local user of the root, and goes
// when the holder's connection ends, as an flock goes with its process.
func TestRemoteLockReleasedWithConnection(t *testing.T) {
	root := t.TempDir()
	ctx := context.Background()
	r := serve(t, root)
	local := NewLocal(root)
	key := ParentLock("ns", "p")
	unlock, ok, err := r.Lock(ctx, key, false)
	if err != nil || !ok {
		t.Fatalf("remote lock: %v %v", ok, err)
	}
	if _, ok, err := local.Lock(ctx, key, false); ok || err != nil {
		t.Fatalf("local lock while the remote holds it: ok=%v %v", ok, err)
	}
	unlock()
	u2, ok, err := local.Lock(ctx, key, false)
	if !ok || err != nil {
		t.Fatalf("local lock after unlock: %v %v", ok, err)
	}
	u2()

	// The op lock marks a live operation until its holder disconnects.
	if err := r.SaveOp(ctx, &api.OpRecord{ID: "abc", Namespace: "ns", Parent: "p", Created: time.Now()}); err != nil {
		t.Fatal(err)
	}
	if _, ok, err := r.Lock(ctx, OpLock("abc"), false); !ok || err != nil {
		t.Fatalf("op lock: %v %v", ok, err)
	}
	ops, err := local.Ops(ctx)
	if err != nil || len(ops) != 1 || !ops[0].Alive || ops[0].Record.Parent != "p" {
		t.Fatalf("ops while the holder lives: %+v %v", ops, err)
	}
	r.Close() // the client dies
	deadline := time.Now().Add(10 * time.Second)
	for {
		ops, _ = local.Ops(ctx)
		if len(ops) == 1 && !ops[0].Alive {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("op still alive after its client's connection closed: %+v", ops)
		}
		time.Sleep(20 * time.Millisecond)
	}
	// A waiting lock gives up with its context.
	u3, _, _ := local.Lock(ctx, key, false)
	defer u3()
	r2 := serve(t, root)
	wctx, cancel := context.WithTimeout(ctx, 200*time.Millisecond)
	defer cancel()
	if _, ok, err := r2.Lock(wctx, key, true); ok || !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("wait for a held lock: ok=%v %v", ok, err)
	}
}

// Errors keep their class across the API; a missing socket is unavailable.
func TestRemoteErrors(t *testing.T) {
	root := t.TempDir()
	ctx := context.Background()
	r := serve(t, root)
	if err := r.RemoveSnapshot(ctx, "/etc"); !errdefs.IsInvalidArgument(err) {
		t.Errorf("remove /etc: %v", err)
	}
	if _, err := r.Snapshot(ctx, filepath.Join(root, "snapshots", "x", "image")); !errdefs.IsNotFound(err) {
		t.Errorf("missing snapshot: %v", err)
	}
	dir, image, err := r.PrepareSnapshot(ctx, "op1")
	if err != nil || image != api.ImageDir(dir) {
		t.Fatalf("prepare: %s %s %v", dir, image, err)
	}
	if _, _, err := r.PrepareSnapshot(ctx, "op1"); !errdefs.IsAlreadyExists(err) {
		t.Errorf("prepare twice: %v", err)
	}
	dirs, err := r.SnapshotDirs(ctx)
	if err != nil || len(dirs) != 1 || dirs[0].Op != "op1" {
		t.Fatalf("dirs: %+v %v", dirs, err)
	}
	if err := r.KeepSnapshot(ctx, dir); err != nil {
		t.Fatal(err)
	}
	if dirs, _ := r.SnapshotDirs(ctx); len(dirs) != 1 || dirs[0].Op != "" {
		t.Errorf("kept snapshot still names its op: %+v", dirs)
	}
	if err := r.RemoveSnapshot(ctx, dir); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(dir); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("snapshot dir left: %v", err)
	}
	gone := NewRemote(filepath.Join(t.TempDir(), "none.sock"))
	if _, err := gone.Families(ctx); !errdefs.IsUnavailable(err) || !strings.Contains(err.Error(), "lazyfork setup") {
		t.Errorf("no socket: %v", err)
	}
}

// A followed log streams what is written until Finish.
func TestRemoteReadLogFollow(t *testing.T) {
	ctx := context.Background()
	r := serve(t, t.TempDir())
	p := filepath.Join(t.TempDir(), "ns", "c.log")
	if err := r.PrepareLog(ctx, p); err != nil {
		t.Fatal(err)
	}
	lr, err := r.ReadLog(ctx, p, true) // not written yet: waited for
	if err != nil {
		t.Fatal(err)
	}
	defer lr.Close()
	if err := os.WriteFile(p, []byte("one\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	buf := make([]byte, 4)
	if _, err := io.ReadFull(lr, buf); err != nil || string(buf) != "one\n" {
		t.Fatalf("first line: %q %v", buf, err)
	}
	f, _ := os.OpenFile(p, os.O_APPEND|os.O_WRONLY, 0)
	f.WriteString("two\n")
	f.Close()
	lr.Finish()
	rest, err := io.ReadAll(lr)
	if err != nil || string(rest) != "two\n" {
		t.Fatalf("rest: %q %v", rest, err)
	}
	names, err := r.LogFiles(ctx, filepath.Dir(p))
	if err != nil || len(names) != 1 || names[0] != "c.log" {
		t.Errorf("log files: %v %v", names, err)
	}
	if _, err := r.ReadLog(ctx, p+".none", false); err != nil {
		t.Fatal(err) // the open error arrives with the first read
	}
	lr2, _ := r.ReadLog(ctx, p+".none", false)
	if _, err := io.ReadAll(lr2); !errdefs.IsNotFound(err) {
		t.Errorf("missing log: %v", err)
	}
	var out bytes.Buffer
	lr3, _ := r.ReadLog(ctx, p, false)
	io.Copy(&out, lr3)
	if out.String() != "one\ntwo\n" {
		t.Errorf("whole log: %q", out.String())
	}
}
