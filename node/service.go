package node

import (
	"context"
	"errors"
	"io"

	"github.com/containerd/errdefs/pkg/errgrpc"

	pb "github.com/lazyfork/lazyfork/proto/lazyfork/v1"
)

// Service serves a Node (on the node: a Local) as lazyfork.v1.Node over
// ttrpc; register it with pb.RegisterNodeService. Errors keep their errdefs
// class across the wire (errgrpc).
type Service struct {
	N Node
	// ForkOf serves SnapshotForPod and CopySnapshotLayer (nil: they fail
	// with ErrNotImplemented).
	ForkOf ForkOf
}

var _ pb.NodeService = (*Service)(nil)

func toGRPC(err error) error {
	if err == nil {
		return nil
	}
	return errgrpc.ToGRPC(err)
}

var empty = &pb.Empty{}

func (s *Service) PrepareSnapshot(ctx context.Context, r *pb.PrepareSnapshotRequest) (*pb.PrepareSnapshotResponse, error) {
	dir, image, err := s.N.PrepareSnapshot(ctx, r.Op)
	if err != nil {
		return nil, toGRPC(err)
	}
	return &pb.PrepareSnapshotResponse{SnapshotDir: dir, ImageDir: image}, nil
}

func (s *Service) KeepSnapshot(ctx context.Context, r *pb.SnapshotDirRequest) (*pb.Empty, error) {
	return empty, toGRPC(s.N.KeepSnapshot(ctx, r.SnapshotDir))
}

func (s *Service) RemoveSnapshot(ctx context.Context, r *pb.SnapshotDirRequest) (*pb.Empty, error) {
	return empty, toGRPC(s.N.RemoveSnapshot(ctx, r.SnapshotDir))
}

func (s *Service) SetRootfs(ctx context.Context, r *pb.SetRootfsRequest) (*pb.Empty, error) {
	return empty, toGRPC(s.N.SetRootfs(ctx, r.SnapshotDir, rootfsFromPB(r.Rootfs)))
}

func (s *Service) ReleaseRootfs(ctx context.Context, r *pb.SnapshotDirRequest) (*pb.Empty, error) {
	return empty, toGRPC(s.N.ReleaseRootfs(ctx, r.SnapshotDir))
}

func (s *Service) GetSnapshot(ctx context.Context, r *pb.GetSnapshotRequest) (*pb.Snapshot, error) {
	sn, err := s.N.Snapshot(ctx, r.ImageDir)
	if err != nil {
		return nil, toGRPC(err)
	}
	return &pb.Snapshot{ImageDir: sn.ImageDir, Family: sn.Family, Pages: sn.Pages, ThawedUnixNano: unixNano(sn.Thawed), PausedNanos: int64(sn.Paused),
		Rootfs: rootfsToPB(sn.Rootfs), Bytes: sn.Bytes, SourceNamespace: sn.SourceNamespace, SourceContainer: sn.SourceContainer}, nil
}

func (s *Service) ListSnapshotDirs(ctx context.Context, _ *pb.Empty) (*pb.ListSnapshotDirsResponse, error) {
	dirs, err := s.N.SnapshotDirs(ctx)
	if err != nil {
		return nil, toGRPC(err)
	}
	out := &pb.ListSnapshotDirsResponse{}
	for _, d := range dirs {
		out.Dirs = append(out.Dirs, &pb.SnapshotDir{Dir: d.Dir, Op: d.Op, MtimeUnixNano: unixNano(d.ModTime), Rootfs: rootfsToPB(d.Rootfs)})
	}
	return out, nil
}

func (s *Service) Families(ctx context.Context, _ *pb.Empty) (*pb.FamiliesResponse, error) {
	fams, err := s.N.Families(ctx)
	if err != nil {
		return nil, toGRPC(err)
	}
	out := &pb.FamiliesResponse{}
	for i := range fams {
		out.Families = append(out.Families, familyToPB(&fams[i]))
	}
	return out, nil
}

func (s *Service) CollectMemory(ctx context.Context, _ *pb.Empty) (*pb.CollectMemoryResponse, error) {
	freed, err := s.N.CollectMemory(ctx)
	if err != nil {
		return nil, toGRPC(err)
	}
	return &pb.CollectMemoryResponse{Freed: freed}, nil
}

func (s *Service) FreeSpace(ctx context.Context, _ *pb.Empty) (*pb.FreeSpaceResponse, error) {
	sp, err := s.N.FreeSpace(ctx)
	if err != nil {
		return nil, toGRPC(err)
	}
	return &pb.FreeSpaceResponse{Root: sp.Root, FreeBytes: sp.Free, MemAvailableBytes: sp.MemAvailable}, nil
}

func (s *Service) SaveOp(ctx context.Context, r *pb.OpRecord) (*pb.Empty, error) {
	return empty, toGRPC(s.N.SaveOp(ctx, opFromPB(r)))
}

func (s *Service) RemoveOp(ctx context.Context, r *pb.RemoveOpRequest) (*pb.Empty, error) {
	return empty, toGRPC(s.N.RemoveOp(ctx, r.Id))
}

func (s *Service) ListOps(ctx context.Context, _ *pb.Empty) (*pb.ListOpsResponse, error) {
	ops, err := s.N.Ops(ctx)
	out := &pb.ListOpsResponse{}
	if err != nil {
		if len(ops) == 0 {
			return nil, toGRPC(err)
		}
		out.Errors = append(out.Errors, err.Error())
	}
	for i := range ops {
		out.Ops = append(out.Ops, &pb.OpState{Record: opToPB(&ops[i].Record), Alive: ops[i].Alive})
	}
	return out, nil
}

// Lock holds the lock the first message names while the client keeps its
// side of the stream open and its connection lives.
func (s *Service) Lock(ctx context.Context, srv pb.Node_LockServer) error {
	req, err := srv.Recv()
	if err != nil {
		return err
	}
	closed := make(chan struct{})
	go func() {
		for {
			if _, err := srv.Recv(); err != nil {
				close(closed)
				return
			}
		}
	}()
	lctx, cancel := context.WithCancel(ctx)
	defer cancel()
	go func() {
		select {
		case <-closed:
			cancel()
		case <-lctx.Done():
		}
	}()
	unlock, ok, err := s.N.Lock(lctx, req.Key, req.Wait)
	if err != nil {
		return toGRPC(err)
	}
	if err := srv.Send(&pb.LockResponse{Held: ok}); err != nil || !ok {
		if ok {
			unlock()
		}
		return err
	}
	select {
	case <-closed:
	case <-ctx.Done():
	}
	unlock()
	return nil
}

func (s *Service) RemoveLock(ctx context.Context, r *pb.LockKey) (*pb.RemoveLockResponse, error) {
	ok, err := s.N.RemoveLock(ctx, r.Key)
	if err != nil {
		return nil, toGRPC(err)
	}
	return &pb.RemoveLockResponse{Removed: ok}, nil
}

func (s *Service) SweepLocks(ctx context.Context, r *pb.SweepLocksRequest) (*pb.SweepLocksResponse, error) {
	removed, err := s.N.SweepLocks(ctx, r.Keep, r.Dry)
	if err != nil {
		return nil, toGRPC(err)
	}
	return &pb.SweepLocksResponse{Removed: removed}, nil
}

func (s *Service) SaveRestoreLog(ctx context.Context, r *pb.SaveRestoreLogRequest) (*pb.SaveRestoreLogResponse, error) {
	p, err := s.N.SaveRestoreLog(ctx, r.Namespace, r.Id)
	if err != nil {
		return nil, toGRPC(err)
	}
	return &pb.SaveRestoreLogResponse{Path: p}, nil
}

func (s *Service) PrepareLog(ctx context.Context, r *pb.LogPath) (*pb.Empty, error) {
	return empty, toGRPC(s.N.PrepareLog(ctx, r.Path))
}

func (s *Service) RemoveLog(ctx context.Context, r *pb.LogPath) (*pb.Empty, error) {
	return empty, toGRPC(s.N.RemoveLog(ctx, r.Path))
}

func (s *Service) ListLogs(ctx context.Context, r *pb.LogPath) (*pb.ListLogsResponse, error) {
	names, err := s.N.LogFiles(ctx, r.Path)
	if err != nil {
		return nil, toGRPC(err)
	}
	return &pb.ListLogsResponse{Names: names}, nil
}

func (s *Service) StatLog(ctx context.Context, r *pb.LogPath) (*pb.StatLogResponse, error) {
	exists, fifo, err := s.N.StatLog(ctx, r.Path)
	if err != nil {
		return nil, toGRPC(err)
	}
	return &pb.StatLogResponse{Exists: exists, Fifo: fifo}, nil
}

// ReadLog streams the log the first message names until its end (or, with
// follow, until the client finishes or closes).
func (s *Service) ReadLog(ctx context.Context, srv pb.Node_ReadLogServer) error {
	req, err := srv.Recv()
	if err != nil {
		return err
	}
	rctx, cancel := context.WithCancel(ctx)
	defer cancel()
	r, err := s.N.ReadLog(rctx, req.Path, req.Follow)
	if err != nil {
		return toGRPC(err)
	}
	defer r.Close()
	// With acks, at most relayWindow chunks are unacknowledged.
	credit := newCredits(rctx.Done())
	go func() {
		for {
			m, err := srv.Recv()
			if err != nil {
				cancel() // the client went away
				return
			}
			credit.give(m.Ack)
			if m.Finish {
				r.Finish()
			}
		}
	}()
	buf := make([]byte, 64<<10)
	for {
		n, err := r.Read(buf)
		if n > 0 {
			if req.Acks && !credit.take() {
				return nil // the client went away
			}
			if serr := srv.Send(&pb.LogChunk{Data: append([]byte(nil), buf[:n]...)}); serr != nil {
				return serr
			}
		}
		if errors.Is(err, io.EOF) {
			return nil
		}
		if err != nil {
			return toGRPC(err)
		}
	}
}

func (s *Service) Usage(ctx context.Context, r *pb.UsageRequest) (*pb.UsageResponse, error) {
	u, err := s.N.Usage(ctx, r.Pid, r.Cgroup)
	if err != nil {
		return nil, toGRPC(err)
	}
	return &pb.UsageResponse{MemoryBytes: u.Memory, MemFileBytes: u.MemFileBytes, MemFileMappings: int64(u.MemFileMappings),
		RssAnonBytes: u.RssAnon, RssSharedBytes: u.RssShared}, nil
}
