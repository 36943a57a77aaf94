//go:build linux

package snapshotter

import (
	"context"
	"os"
	"path/filepath"

	"github.com/containerd/containerd/v2/core/snapshots"
	"github.com/containerd/containerd/v2/core/snapshots/storage"
	"github.com/containerd/errdefs/pkg/errgrpc"
	"golang.org/x/sys/unix"

	lazyforkv1 "github.com/lazyfork/lazyfork/proto/lazyfork/v1"
	"github.com/lazyfork/lazyfork/snapshotter/client"
)

// Status is what the ttrpc Status call reports.
func (s *Snapshotter) Status(ctx context.Context) (*lazyforkv1.StatusResponse, error) {
	st := &lazyforkv1.StatusResponse{Root: s.root, Reflink: s.reflink()}
	if err := s.ms.WithTransaction(ctx, false, func(ctx context.Context) error {
		return storage.WalkInfo(ctx, func(ctx context.Context, info snapshots.Info) error {
			switch info.Kind {
			case snapshots.KindActive:
				st.Active++
			case snapshots.KindView:
				st.Views++
			case snapshots.KindCommitted:
				st.Committed++
				if _, ok := info.Labels[client.FrozenFromLabel]; ok {
					st.Frozen++
					if _, _, u, err := storage.GetInfo(ctx, info.Name); err == nil {
						st.FrozenBytes += u.Size
					}
				}
			}
			return nil
		})
	}); err != nil {
		return nil, err
	}
	missing, err := s.missingDirs(ctx)
	if err != nil {
		return nil, err
	}
	st.Missing = missing
	st.Building = uint64(s.building.Load())
	return st, nil
}

// reflink probes whether the root's filesystem clones files.
func (s *Snapshotter) reflink() bool {
	dir, err := os.MkdirTemp(s.root, ".probe-")
	if err != nil {
		return false
	}
	defer os.RemoveAll(dir)
	a, err := os.Create(filepath.Join(dir, "a"))
	if err != nil {
		return false
	}
	defer a.Close()
	if _, err := a.Write([]byte("x")); err != nil {
		return false
	}
	b, err := os.Create(filepath.Join(dir, "b"))
	if err != nil {
		return false
	}
	defer b.Close()
	return unix.IoctlFileClone(int(b.Fd()), int(a.Fd())) == nil
}

// Service serves the lazyfork.v1 ttrpc API of a Snapshotter.
type Service struct {
	S       *Snapshotter
	Version string
}

var _ lazyforkv1.SnapshotterService = (*Service)(nil)

// Status implements lazyforkv1.SnapshotterService.
func (v *Service) Status(ctx context.Context, _ *lazyforkv1.StatusRequest) (*lazyforkv1.StatusResponse, error) {
	st, err := v.S.Status(ctx)
	if err != nil {
		return nil, errgrpc.ToGRPC(err)
	}
	st.Version = v.Version
	return st, nil
}
