// Package forkof is the node side of a pod's lazyfork.io/fork-of that names
// a running container or a kept snapshot (node.ForkOf): LazyFork's fork
// client, connected for the call to the containerd the request names, on
// the LazyFork root this node serves. lazyfork-snapshotter serves it on the
// node API so that the shim, which asks for it, links neither containerd's
// client nor gRPC (its start-up is paid by every fork and container).
//
// Who may call: the node API's socket is root's (0600 in a 0700 directory),
// and a caller of it may already checkpoint any container through
// containerd's socket; the shim that asks checks the snapshot it gets back
// as any other (shim/trust.go: under ROOT/snapshots, its source record
// against the pod's namespace and opt-in).
package forkof

import (
	"context"
	"fmt"
	"path/filepath"

	containerd "github.com/containerd/containerd/v2/client"
	"github.com/containerd/containerd/v2/pkg/namespaces"
	"github.com/containerd/errdefs"
	"github.com/containerd/log"

	"github.com/lazyfork/lazyfork/client"
	"github.com/lazyfork/lazyfork/node"
)

// Server is node.ForkOf on the files of LazyFork root Root.
type Server struct {
	Root string
}

var _ node.ForkOf = (*Server)(nil)

// SnapshotForPod is client.SnapshotForPod in r's containerd namespace: the
// snapshot is unclaimed (lazyfork gc's) until the caller claims it. A call
// whose caller went away (its context ended) once the snapshot is made
// removes it at once: nobody will claim it.
func (s *Server) SnapshotForPod(ctx context.Context, r node.PodSnapshot) (imageDir string, err error) {
	if err := s.check(r.ForkOfContext, r.Upper); err != nil {
		return "", err
	}
	err = s.withClient(ctx, r.ForkOfContext, func(ctx context.Context, lf *client.Client) error {
		image, err := lf.SnapshotForPod(ctx, r.Ref, r.Upper, r.PodNamespace)
		if err != nil {
			return err
		}
		if err := ctx.Err(); err != nil {
			if rerr := lf.RemoveSnapshot(context.WithoutCancel(ctx), image); rerr != nil {
				log.G(ctx).WithError(rerr).WithField("snapshot", image).Warn("lazyfork: remove the snapshot of a cancelled fork-of")
			}
			return fmt.Errorf("the caller went away: %w", err)
		}
		imageDir = image
		return nil
	})
	return imageDir, err
}

// CopySnapshotLayer is client.CopySnapshotLayer in r's containerd namespace.
func (s *Server) CopySnapshotLayer(ctx context.Context, r node.PodLayer) error {
	if err := s.check(r.ForkOfContext, r.Upper); err != nil {
		return err
	}
	if !filepath.IsAbs(r.ImageDir) {
		return fmt.Errorf("snapshot %q: not an absolute path: %w", r.ImageDir, errdefs.ErrInvalidArgument)
	}
	return s.withClient(ctx, r.ForkOfContext, func(ctx context.Context, lf *client.Client) error {
		return lf.CopySnapshotLayer(ctx, r.ImageDir, r.Upper)
	})
}

func (s *Server) check(c node.ForkOfContext, upper string) error {
	if err := c.Check(s.Root); err != nil {
		return err
	}
	if !filepath.IsAbs(upper) {
		return fmt.Errorf("the fork's upper directory %q: not an absolute path: %w", upper, errdefs.ErrInvalidArgument)
	}
	return nil
}

// withClient runs f with a fork client connected to the containerd at
// c.Containerd, in namespace c.Namespace and this server's LazyFork root.
// The connection lasts for the call.
func (s *Server) withClient(ctx context.Context, c node.ForkOfContext, f func(context.Context, *client.Client) error) error {
	cd, err := containerd.New(c.Containerd, containerd.WithDefaultNamespace(c.Namespace))
	if err != nil {
		return fmt.Errorf("connect to containerd at %s: %w", c.Containerd, err)
	}
	defer cd.Close()
	return f(namespaces.WithNamespace(ctx, c.Namespace), client.New(cd, client.WithRoot(s.Root)))
}
