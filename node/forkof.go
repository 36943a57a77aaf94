package node

import (
	"context"
	"fmt"
	"path/filepath"

	"github.com/containerd/errdefs"

	pb "github.com/lazyfork/lazyfork/proto/lazyfork/v1"
)

// ForkOf serves the part of a pod's lazyfork.io/fork-of that needs
// containerd's client: snapshotting a running container and copying a kept
// snapshot's writable layer into the fork's upper directory. The shim asks
// it of the node API (a Remote) so that its binary links neither
// containerd's client nor gRPC; lazyfork-snapshotter implements it with
// LazyFork's fork client (package node/forkof) and serves it with Service.
type ForkOf interface {
	// SnapshotForPod snapshots the running container r.Ref for one fork
	// whose root filesystem has upper directory r.Upper and returns the
	// snapshot's image directory, under r.Root's snapshots/. The caller
	// owns the snapshot (RemoveSnapshot). On error nothing is left behind.
	SnapshotForPod(ctx context.Context, r PodSnapshot) (imageDir string, err error)
	// CopySnapshotLayer copies the writable layer the kept snapshot at
	// r.ImageDir recorded into r.Upper.
	CopySnapshotLayer(ctx context.Context, r PodLayer) error
}

// ForkOfContext is where a fork-of works: containerd's address (the shim's
// GRPC_ADDRESS), the fork's containerd namespace, and the LazyFork root the
// caller expects the snapshot under (a server serving another root refuses).
type ForkOfContext struct {
	Containerd, Namespace, Root string
}

// PodSnapshot asks for a snapshot of a running container for one fork.
type PodSnapshot struct {
	ForkOfContext
	// Ref is the parent: its id, or NAMESPACE/POD/CONTAINER.
	Ref string
	// Upper is the fork's overlay upper directory.
	Upper string
	// PodNamespace is the fork's Kubernetes namespace ("" outside a pod):
	// the parent must be in it and have opted in.
	PodNamespace string
}

// PodLayer asks for a kept snapshot's writable layer in a fork's upper
// directory.
type PodLayer struct {
	ForkOfContext
	ImageDir, Upper string
}

// Check reports the first unusable field of c for a server serving LazyFork
// root root.
func (c ForkOfContext) Check(root string) error {
	switch {
	case c.Containerd == "":
		return fmt.Errorf("fork-of: no containerd address in the request (the shim's GRPC_ADDRESS): %w", errdefs.ErrInvalidArgument)
	case c.Namespace == "":
		return fmt.Errorf("fork-of: no containerd namespace in the request: %w", errdefs.ErrInvalidArgument)
	case !filepath.IsAbs(c.Root):
		return fmt.Errorf("fork-of: LazyFork root %q in the request is not an absolute path: %w", c.Root, errdefs.ErrInvalidArgument)
	case filepath.Clean(c.Root) != filepath.Clean(root):
		return fmt.Errorf("fork-of: this node API serves LazyFork root %s, the caller's root is %s: run lazyfork-snapshotter with --lazyfork-root %s (or point the shim's LAZYFORK_API at the one that serves it): %w",
			root, c.Root, c.Root, errdefs.ErrFailedPrecondition)
	}
	return nil
}

func forkOfContextFromPB(c *pb.ForkOfContext) ForkOfContext {
	if c == nil {
		return ForkOfContext{}
	}
	return ForkOfContext{Containerd: c.ContainerdAddress, Namespace: c.Namespace, Root: c.Root}
}

func forkOfContextToPB(c ForkOfContext) *pb.ForkOfContext {
	return &pb.ForkOfContext{ContainerdAddress: c.Containerd, Namespace: c.Namespace, Root: c.Root}
}

func (s *Service) forkOf() (ForkOf, error) {
	if s.ForkOf == nil {
		return nil, fmt.Errorf("this LazyFork node API does not serve fork-of of a running container or a kept snapshot (an older lazyfork-snapshotter?): upgrade lazyfork-snapshotter: %w", errdefs.ErrNotImplemented)
	}
	return s.ForkOf, nil
}

func (s *Service) SnapshotForPod(ctx context.Context, r *pb.SnapshotForPodRequest) (*pb.SnapshotForPodResponse, error) {
	f, err := s.forkOf()
	if err != nil {
		return nil, toGRPC(err)
	}
	image, err := f.SnapshotForPod(ctx, PodSnapshot{ForkOfContext: forkOfContextFromPB(r.Context), Ref: r.Ref, Upper: r.UpperDir, PodNamespace: r.PodNamespace})
	if err != nil {
		return nil, toGRPC(err)
	}
	return &pb.SnapshotForPodResponse{ImageDir: image}, nil
}

func (s *Service) CopySnapshotLayer(ctx context.Context, r *pb.CopySnapshotLayerRequest) (*pb.Empty, error) {
	f, err := s.forkOf()
	if err != nil {
		return nil, toGRPC(err)
	}
	return empty, toGRPC(f.CopySnapshotLayer(ctx, PodLayer{ForkOfContext: forkOfContextFromPB(r.Context), ImageDir: r.ImageDir, Upper: r.UpperDir}))
}

var _ ForkOf = (*Remote)(nil)

// SnapshotForPod asks the node's lazyfork-snapshotter (ForkOf).
func (r *Remote) SnapshotForPod(ctx context.Context, req PodSnapshot) (string, error) {
	resp, err := call(r, func(c pb.NodeClient) (*pb.SnapshotForPodResponse, error) {
		return c.SnapshotForPod(ctx, &pb.SnapshotForPodRequest{Context: forkOfContextToPB(req.ForkOfContext),
			Ref: req.Ref, UpperDir: req.Upper, PodNamespace: req.PodNamespace})
	})
	if err != nil {
		return "", err
	}
	return resp.ImageDir, nil
}

// CopySnapshotLayer asks the node's lazyfork-snapshotter (ForkOf).
func (r *Remote) CopySnapshotLayer(ctx context.Context, req PodLayer) error {
	_, err := call(r, func(c pb.NodeClient) (*pb.Empty, error) {
		return c.CopySnapshotLayer(ctx, &pb.CopySnapshotLayerRequest{Context: forkOfContextToPB(req.ForkOfContext),
			ImageDir: req.ImageDir, UpperDir: req.Upper})
	})
	return err
}
