package node

import (
	"context"
	"fmt"
	"net"
	"path/filepath"
	"strings"
	"testing"

	"github.com/containerd/errdefs"
	"github.com/containerd/ttrpc"

	pb "github.com/lazyfork/lazyfork/proto/lazyfork/v1"
)

// fakeForkOf records what it was asked and answers as told.
type fakeForkOf struct {
	snap  PodSnapshot
	layer PodLayer
	image string
	err   error
}

func (f *fakeForkOf) SnapshotForPod(_ context.Context, r PodSnapshot) (string, error) {
	f.snap = r
	return f.image, f.err
}

func (f *fakeForkOf) CopySnapshotLayer(_ context.Context, r PodLayer) error {
	f.layer = r
	return f.err
}

func serveForkOf(t *testing.T, f ForkOf) *Remote {
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
	pb.RegisterNodeService(srv, &Service{N: NewLocal(t.TempDir()), ForkOf: f})
	go srv.Serve(context.Background(), l)
	t.Cleanup(func() { srv.Close() })
	r := NewRemote(sock)
	t.Cleanup(func() { r.Close() })
	return r
}

// The fork-of calls cross the API with every field, and their errors keep
// their class and say what to do.
func TestForkOfOverAPI(t *testing.T) {
	ctx := context.Background()
	fc := ForkOfContext{Containerd: "/run/cd.sock", Namespace: "k8s.io", Root: "/run/lazyfork"}
	f := &fakeForkOf{image: "/run/lazyfork/snapshots/op/image"}
	r := serveForkOf(t, f)
	want := PodSnapshot{ForkOfContext: fc, Ref: "default/web/counter", Upper: "/var/lib/x/fs", PodNamespace: "default"}
	image, err := r.SnapshotForPod(ctx, want)
	if err != nil || image != f.image || f.snap != want {
		t.Fatalf("SnapshotForPod: %q %v; the server got %+v, want %+v", image, err, f.snap, want)
	}
	wantLayer := PodLayer{ForkOfContext: fc, ImageDir: "/run/lazyfork/snapshots/kept/image", Upper: "/var/lib/y/fs"}
	if err := r.CopySnapshotLayer(ctx, wantLayer); err != nil || f.layer != wantLayer {
		t.Fatalf("CopySnapshotLayer: %v; the server got %+v, want %+v", err, f.layer, wantLayer)
	}
	f.err = fmt.Errorf("a pod of Kubernetes namespace %q cannot fork it: %w", "x", errdefs.ErrPermissionDenied)
	if _, err := r.SnapshotForPod(ctx, want); !errdefs.IsPermissionDenied(err) || !strings.Contains(err.Error(), "cannot fork it") {
		t.Errorf("a refused SnapshotForPod: %v, want permission denied with the server's reason", err)
	}

	// A server without fork-of (an older snapshotter) says to upgrade.
	old := serve(t, t.TempDir())
	if _, err := old.SnapshotForPod(ctx, want); !errdefs.IsNotImplemented(err) || !strings.Contains(err.Error(), "upgrade lazyfork-snapshotter") {
		t.Errorf("SnapshotForPod of a server without fork-of: %v", err)
	}
	if err := old.CopySnapshotLayer(ctx, wantLayer); !errdefs.IsNotImplemented(err) {
		t.Errorf("CopySnapshotLayer of a server without fork-of: %v", err)
	}
}

// A request is refused unless it names containerd, a namespace and the
// root the server serves; a different root says how to align the two.
func TestForkOfContextCheck(t *testing.T) {
	ok := ForkOfContext{Containerd: "/run/cd.sock", Namespace: "k8s.io", Root: "/run/lazyfork/"}
	if err := ok.Check("/run/lazyfork"); err != nil {
		t.Fatalf("a matching request: %v", err)
	}
	for _, tc := range []struct {
		c    ForkOfContext
		is   func(error) bool
		says string
	}{
		{ForkOfContext{Namespace: "k8s.io", Root: "/run/lazyfork"}, errdefs.IsInvalidArgument, "GRPC_ADDRESS"},
		{ForkOfContext{Containerd: "/run/cd.sock", Root: "/run/lazyfork"}, errdefs.IsInvalidArgument, "namespace"},
		{ForkOfContext{Containerd: "/run/cd.sock", Namespace: "k8s.io", Root: "run/lazyfork"}, errdefs.IsInvalidArgument, "absolute"},
		{ForkOfContext{Containerd: "/run/cd.sock", Namespace: "k8s.io", Root: "/tmp/other"}, errdefs.IsFailedPrecondition, "--lazyfork-root /tmp/other"},
	} {
		if err := tc.c.Check("/run/lazyfork"); err == nil || !tc.is(err) || !strings.Contains(err.Error(), tc.says) {
			t.Errorf("%+v: %v, want an error saying %q", tc.c, err, tc.says)
		}
	}
}
