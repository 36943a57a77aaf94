package node

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"sync"
	"time"

	"github.com/containerd/errdefs"
	"github.com/containerd/errdefs/pkg/errgrpc"
	"github.com/containerd/ttrpc"

	"github.com/lazyfork/lazyfork/api"
	pb "github.com/lazyfork/lazyfork/proto/lazyfork/v1"
)

// Remote is a Node served by lazyfork-snapshotter over ttrpc. It dials
// its socket at the first call.
type Remote struct {
	socket string

	mu   sync.Mutex
	conn *ttrpc.Client
	c    pb.NodeClient
}

var _ Node = (*Remote)(nil)

// DialTimeout bounds the connection to the API socket.
const DialTimeout = 5 * time.Second

// NewRemote is the Node served at socket (a unix socket path).
func NewRemote(socket string) *Remote { return &Remote{socket: socket} }

// Socket is the API socket.
func (r *Remote) Socket() string { return r.socket }

func (r *Remote) client() (pb.NodeClient, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.c != nil {
		return r.c, nil
	}
	conn, err := net.DialTimeout("unix", r.socket, DialTimeout)
	if err != nil {
		return nil, fmt.Errorf("no LazyFork API at %s (%v): lazyfork-snapshotter serves it; start it with lazyfork setup, or point --api / LAZYFORK_API at it: %w",
			r.socket, err, errdefs.ErrUnavailable)
	}
	r.conn = ttrpc.NewClient(conn)
	r.c = pb.NewNodeClient(r.conn)
	return r.c, nil
}

// Close closes the connection, releasing every lock it holds.
func (r *Remote) Close() error {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.conn == nil {
		return nil
	}
	err := r.conn.Close()
	r.conn, r.c = nil, nil
	return err
}

// call runs f with the client; errors come back as errdefs classes.
func call[T any](r *Remote, f func(pb.NodeClient) (T, error)) (T, error) {
	c, err := r.client()
	if err != nil {
		var zero T
		return zero, err
	}
	v, err := f(c)
	if err != nil {
		return v, fromGRPC(err)
	}
	return v, nil
}

func fromGRPC(err error) error {
	if err == nil {
		return nil
	}
	if errors.Is(err, ttrpc.ErrClosed) {
		return fmt.Errorf("LazyFork API: %v: %w", err, errdefs.ErrUnavailable)
	}
	return errgrpc.ToNative(err)
}

func (r *Remote) PrepareSnapshot(ctx context.Context, op string) (string, string, error) {
	resp, err := call(r, func(c pb.NodeClient) (*pb.PrepareSnapshotResponse, error) {
		return c.PrepareSnapshot(ctx, &pb.PrepareSnapshotRequest{Op: op})
	})
	if err != nil {
		return "", "", err
	}
	return resp.SnapshotDir, resp.ImageDir, nil
}

func (r *Remote) KeepSnapshot(ctx context.Context, dir string) error {
	_, err := call(r, func(c pb.NodeClient) (*pb.Empty, error) {
		return c.KeepSnapshot(ctx, &pb.SnapshotDirRequest{SnapshotDir: dir})
	})
	return err
}

func (r *Remote) RemoveSnapshot(ctx context.Context, dir string) error {
	_, err := call(r, func(c pb.NodeClient) (*pb.Empty, error) {
		return c.RemoveSnapshot(ctx, &pb.SnapshotDirRequest{SnapshotDir: dir})
	})
	return err
}

func (r *Remote) SetRootfs(ctx context.Context, dir string, rec *api.RootfsRecord) error {
	_, err := call(r, func(c pb.NodeClient) (*pb.Empty, error) {
		return c.SetRootfs(ctx, &pb.SetRootfsRequest{SnapshotDir: dir, Rootfs: rootfsToPB(rec)})
	})
	return err
}

func (r *Remote) ReleaseRootfs(ctx context.Context, dir string) error {
	_, err := call(r, func(c pb.NodeClient) (*pb.Empty, error) {
		return c.ReleaseRootfs(ctx, &pb.SnapshotDirRequest{SnapshotDir: dir})
	})
	return err
}

func (r *Remote) Snapshot(ctx context.Context, imageDir string) (*Snapshot, error) {
	s, err := call(r, func(c pb.NodeClient) (*pb.Snapshot, error) {
		return c.GetSnapshot(ctx, &pb.GetSnapshotRequest{ImageDir: imageDir})
	})
	if err != nil {
		return nil, err
	}
	return &Snapshot{ImageDir: s.ImageDir, Family: s.Family, Pages: s.Pages, Thawed: fromUnixNano(s.ThawedUnixNano), Paused: time.Duration(s.PausedNanos),
		Rootfs: rootfsFromPB(s.Rootfs), Bytes: s.Bytes, SourceNamespace: s.SourceNamespace, SourceContainer: s.SourceContainer}, nil
}

func (r *Remote) SnapshotDirs(ctx context.Context) ([]SnapshotDir, error) {
	resp, err := call(r, func(c pb.NodeClient) (*pb.ListSnapshotDirsResponse, error) {
		return c.ListSnapshotDirs(ctx, &pb.Empty{})
	})
	if err != nil {
		return nil, err
	}
	out := make([]SnapshotDir, 0, len(resp.Dirs))
	for _, d := range resp.Dirs {
		out = append(out, SnapshotDir{Dir: d.Dir, Op: d.Op, ModTime: fromUnixNano(d.MtimeUnixNano), Rootfs: rootfsFromPB(d.Rootfs)})
	}
	return out, nil
}

func (r *Remote) Families(ctx context.Context) ([]Family, error) {
	resp, err := call(r, func(c pb.NodeClient) (*pb.FamiliesResponse, error) {
		return c.Families(ctx, &pb.Empty{})
	})
	if err != nil {
		return nil, err
	}
	out := make([]Family, 0, len(resp.Families))
	for _, f := range resp.Families {
		out = append(out, familyFromPB(f))
	}
	return out, nil
}

func (r *Remote) CollectMemory(ctx context.Context) ([]string, error) {
	resp, err := call(r, func(c pb.NodeClient) (*pb.CollectMemoryResponse, error) {
		return c.CollectMemory(ctx, &pb.Empty{})
	})
	if err != nil {
		return nil, err
	}
	return resp.Freed, nil
}

func (r *Remote) FreeSpace(ctx context.Context) (Space, error) {
	resp, err := call(r, func(c pb.NodeClient) (*pb.FreeSpaceResponse, error) {
		return c.FreeSpace(ctx, &pb.Empty{})
	})
	if err != nil {
		return Space{}, err
	}
	return Space{Root: resp.Root, Free: resp.FreeBytes, MemAvailable: resp.MemAvailableBytes}, nil
}

func (r *Remote) SaveOp(ctx context.Context, rec *api.OpRecord) error {
	_, err := call(r, func(c pb.NodeClient) (*pb.Empty, error) { return c.SaveOp(ctx, opToPB(rec)) })
	return err
}

func (r *Remote) RemoveOp(ctx context.Context, id string) error {
	_, err := call(r, func(c pb.NodeClient) (*pb.Empty, error) { return c.RemoveOp(ctx, &pb.RemoveOpRequest{Id: id}) })
	return err
}

func (r *Remote) Ops(ctx context.Context) ([]OpState, error) {
	resp, err := call(r, func(c pb.NodeClient) (*pb.ListOpsResponse, error) { return c.ListOps(ctx, &pb.Empty{}) })
	if err != nil {
		return nil, err
	}
	out := make([]OpState, 0, len(resp.Ops))
	for _, o := range resp.Ops {
		out = append(out, OpState{Record: *opFromPB(o.Record), Alive: o.Alive})
	}
	var errs []error
	for _, e := range resp.Errors {
		errs = append(errs, fmt.Errorf("%s: %w", e, errdefs.ErrDataLoss))
	}
	return out, errors.Join(errs...)
}

// Lock holds lock key through a stream: the server keeps the lock until
// unlock closes the stream or the connection ends.
func (r *Remote) Lock(ctx context.Context, key string, wait bool) (func(), bool, error) {
	c, err := r.client()
	if err != nil {
		return nil, false, err
	}
	// The stream outlives ctx (a lock is held past the call that took
	// it); ctx bounds only the wait.
	sctx, cancel := context.WithCancel(context.WithoutCancel(ctx))
	st, err := c.Lock(sctx)
	if err != nil {
		cancel()
		return nil, false, fromGRPC(err)
	}
	if err := st.Send(&pb.LockRequest{Key: key, Wait: wait}); err != nil {
		cancel()
		return nil, false, fromGRPC(err)
	}
	type answer struct {
		held bool
		err  error
	}
	ans := make(chan answer, 1)
	done := make(chan struct{}) // the server ended the stream: no lock held
	go func() {
		defer close(done)
		m, err := st.Recv()
		if err != nil {
			ans <- answer{err: fromGRPC(err)}
			return
		}
		ans <- answer{held: m.Held}
		for {
			if _, err := st.Recv(); err != nil {
				return
			}
		}
	}()
	release := func() {
		_ = st.CloseSend()
		select {
		case <-done:
		case <-time.After(10 * time.Second):
		}
		cancel()
	}
	select {
	case a := <-ans:
		if a.err != nil || !a.held {
			release()
			return nil, false, a.err
		}
		var once sync.Once
		return func() { once.Do(release) }, true, nil
	case <-ctx.Done():
		release()
		return nil, false, fmt.Errorf("wait for lock %s: %w", key, ctx.Err())
	}
}

func (r *Remote) RemoveLock(ctx context.Context, key string) (bool, error) {
	resp, err := call(r, func(c pb.NodeClient) (*pb.RemoveLockResponse, error) {
		return c.RemoveLock(ctx, &pb.LockKey{Key: key})
	})
	if err != nil {
		return false, err
	}
	return resp.Removed, nil
}

func (r *Remote) SweepLocks(ctx context.Context, keep []string, dry bool) ([]string, error) {
	resp, err := call(r, func(c pb.NodeClient) (*pb.SweepLocksResponse, error) {
		return c.SweepLocks(ctx, &pb.SweepLocksRequest{Keep: keep, Dry: dry})
	})
	if err != nil {
		return nil, err
	}
	return resp.Removed, nil
}

func (r *Remote) SaveRestoreLog(ctx context.Context, ns, id string) (string, error) {
	resp, err := call(r, func(c pb.NodeClient) (*pb.SaveRestoreLogResponse, error) {
		return c.SaveRestoreLog(ctx, &pb.SaveRestoreLogRequest{Namespace: ns, Id: id})
	})
	if err != nil {
		return "", err
	}
	return resp.Path, nil
}

func (r *Remote) PrepareLog(ctx context.Context, path string) error {
	_, err := call(r, func(c pb.NodeClient) (*pb.Empty, error) { return c.PrepareLog(ctx, &pb.LogPath{Path: path}) })
	return err
}

func (r *Remote) RemoveLog(ctx context.Context, path string) error {
	_, err := call(r, func(c pb.NodeClient) (*pb.Empty, error) { return c.RemoveLog(ctx, &pb.LogPath{Path: path}) })
	return err
}

func (r *Remote) LogFiles(ctx context.Context, dir string) ([]string, error) {
	resp, err := call(r, func(c pb.NodeClient) (*pb.ListLogsResponse, error) { return c.ListLogs(ctx, &pb.LogPath{Path: dir}) })
	if err != nil {
		return nil, err
	}
	return resp.Names, nil
}

func (r *Remote) StatLog(ctx context.Context, path string) (bool, bool, error) {
	resp, err := call(r, func(c pb.NodeClient) (*pb.StatLogResponse, error) { return c.StatLog(ctx, &pb.LogPath{Path: path}) })
	if err != nil {
		return false, false, err
	}
	return resp.Exists, resp.Fifo, nil
}

// ReadLog streams a log from the node.
func (r *Remote) ReadLog(ctx context.Context, path string, follow bool) (LogReader, error) {
	c, err := r.client()
	if err != nil {
		return nil, err
	}
	sctx, cancel := context.WithCancel(ctx)
	st, err := c.ReadLog(sctx)
	if err != nil {
		cancel()
		return nil, fromGRPC(err)
	}
	if err := st.Send(&pb.ReadLogRequest{Path: path, Follow: follow, Acks: true}); err != nil {
		cancel()
		return nil, fromGRPC(err)
	}
	return &remoteLog{ctx: ctx, st: st, cancel: cancel}, nil
}

type remoteLog struct {
	ctx    context.Context
	st     pb.Node_ReadLogClient
	cancel context.CancelFunc
	buf    []byte
	mu     sync.Mutex
	read   uint32 // chunks read since the last ack
	ended  bool   // the node ended the stream: nothing more is sent on it
}

func (l *remoteLog) Read(b []byte) (int, error) {
	for len(l.buf) == 0 {
		m, err := l.st.Recv()
		if err != nil {
			l.mu.Lock()
			l.ended = true
			l.mu.Unlock()
			if errors.Is(err, io.EOF) || l.ctx.Err() != nil {
				return 0, io.EOF
			}
			return 0, fromGRPC(err)
		}
		l.buf = m.Data
		if l.read++; l.read == relayAck {
			l.mu.Lock()
			_ = l.st.Send(&pb.ReadLogRequest{Ack: l.read})
			l.mu.Unlock()
			l.read = 0
		}
	}
	n := copy(b, l.buf)
	l.buf = l.buf[n:]
	return n, nil
}

func (l *remoteLog) Finish() {
	l.mu.Lock()
	defer l.mu.Unlock()
	if !l.ended {
		_ = l.st.Send(&pb.ReadLogRequest{Finish: true})
	}
}

// Close ends the stream. A reader that stops early (lazyfork logs NAME |
// head) leaves chunks in flight, up to the node's window: they are read and
// dropped here until the node, which stops at the close, ends the stream.
// Left to arrive on a stream already gone, each made ttrpc log an error on
// the user's terminal ("received message on inactive stream").
func (l *remoteLog) Close() error {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.ended {
		// A close sent now would get the node's "no longer active" back.
		l.cancel()
		return nil
	}
	_ = l.st.CloseSend()
	giveUp := time.AfterFunc(closeDrain, l.cancel)
	for {
		if _, err := l.st.Recv(); err != nil {
			break
		}
	}
	giveUp.Stop()
	l.cancel()
	return nil
}

// closeDrain bounds how long Close waits for a node to end its stream.
const closeDrain = 2 * time.Second

func (r *Remote) Usage(ctx context.Context, pid uint32, cgroup string) (Usage, error) {
	resp, err := call(r, func(c pb.NodeClient) (*pb.UsageResponse, error) {
		return c.Usage(ctx, &pb.UsageRequest{Pid: pid, Cgroup: cgroup})
	})
	if err != nil {
		return Usage{}, err
	}
	return Usage{Memory: resp.MemoryBytes, MemFileBytes: resp.MemFileBytes, MemFileMappings: int(resp.MemFileMappings),
		RssAnon: resp.RssAnonBytes, RssShared: resp.RssSharedBytes}, nil
}
