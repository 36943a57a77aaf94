//go:build linux

package server

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"sync"
	"time"

	snapshotsapi "github.com/containerd/containerd/api/services/snapshots/v1"
	"github.com/containerd/containerd/v2/contrib/snapshotservice"
	"github.com/containerd/errdefs"
	"github.com/containerd/log"
	"github.com/containerd/ttrpc"
	"google.golang.org/grpc"

	"github.com/lazyfork/lazyfork/node"
	"github.com/lazyfork/lazyfork/node/forkof"
	lazyforkv1 "github.com/lazyfork/lazyfork/proto/lazyfork/v1"
	"github.com/lazyfork/lazyfork/snapshotter"
)

// Server serves one snapshotter on its two sockets.
type Server struct {
	cfg   Config
	sn    *snapshotter.Snapshotter
	grpc  *grpc.Server
	ttrpc *ttrpc.Server
	lns   []net.Listener
	node  *node.Local

	stopOnce sync.Once

	// The memory collection: Serve starts it unless Stop came first; Stop
	// cancels it and waits for it.
	gcMu     sync.Mutex
	stopping bool
	stopGC   context.CancelFunc
	gcDone   chan struct{}
}

// New opens the snapshotter (reconciling its root) and binds both sockets.
func New(ctx context.Context, cfg Config, version string) (*Server, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	var opts []snapshotter.Option
	if len(cfg.MountOptions) > 0 {
		opts = append(opts, snapshotter.WithMountOptions(cfg.MountOptions...))
	}
	if cfg.AsyncRemove {
		opts = append(opts, snapshotter.WithAsyncRemove())
	}
	sn, err := snapshotter.New(ctx, cfg.Root, opts...)
	if err != nil {
		return nil, err
	}
	// WaitForHandlers: Stop returns only once cancelled calls have cleaned
	// up (a cancelled freeze removes its partial copy) and before the
	// metadata store closes under them.
	s := &Server{cfg: cfg, sn: sn, grpc: grpc.NewServer(grpc.WaitForHandlers(true)),
		node: node.NewLocal(cfg.LazyForkRoot)}
	snapshotsapi.RegisterSnapshotsServer(s.grpc, snapshotservice.FromSnapshotter(sn))
	s.ttrpc, err = ttrpc.NewServer()
	if err != nil {
		sn.Close()
		return nil, err
	}
	lazyforkv1.RegisterSnapshotterService(s.ttrpc, &snapshotter.Service{S: sn, Version: version})
	// The node API: what clients need of LazyFork's root (package node),
	// and the shims' fork-of of a running container or a kept snapshot.
	lazyforkv1.RegisterNodeService(s.ttrpc, &node.Service{N: s.node, ForkOf: &forkof.Server{Root: cfg.LazyForkRoot}})
	// Processes' stdio for clients that share no fifo directory with the shim.
	lazyforkv1.RegisterStdioService(s.ttrpc, &node.StdioService{})

	for _, a := range []string{cfg.Address, cfg.ttrpcAddress()} {
		l, err := listen(ctx, a)
		if err != nil {
			s.closeListeners()
			sn.Close()
			return nil, err
		}
		s.lns = append(s.lns, l)
	}
	return s, nil
}

// Snapshotter is the snapshotter being served.
func (s *Server) Snapshotter() *snapshotter.Snapshotter { return s.sn }

// Serve serves until Stop; it returns the first serving error.
func (s *Server) Serve(ctx context.Context) error {
	errc := make(chan error, 2)
	go func() { errc <- s.grpc.Serve(s.lns[0]) }()
	go func() { errc <- s.ttrpc.Serve(ctx, s.lns[1]) }()
	s.startMemoryCollection(ctx)
	log.G(ctx).WithField("address", s.cfg.Address).WithField("ttrpc", s.cfg.ttrpcAddress()).
		WithField("root", s.cfg.Root).WithField("lazyfork_root", s.cfg.LazyForkRoot).
		WithField("memory_gc_interval", time.Duration(s.cfg.MemoryGCInterval)).Info("lazyfork-snapshotter serving")
	var first error
	for range 2 {
		err := <-errc
		if err != nil && !errors.Is(err, grpc.ErrServerStopped) && !errors.Is(err, ttrpc.ErrServerClosed) && first == nil {
			first = err
			s.Stop(ctx, false)
		}
	}
	return first
}

// Stop stops serving, removes the sockets and closes the snapshotter.
// graceful waits (up to a minute) for calls in flight; otherwise they are
// cancelled.
func (s *Server) Stop(ctx context.Context, graceful bool) {
	s.stopOnce.Do(func() {
		s.stopMemoryCollection()
		if graceful {
			done := make(chan struct{})
			go func() {
				s.grpc.GracefulStop()
				close(done)
			}()
			select {
			case <-done:
			case <-time.After(time.Minute):
				log.G(ctx).Warn("calls still running after a minute; cancelling them")
				s.grpc.Stop()
			}
			sctx, cancel := context.WithTimeout(ctx, 10*time.Second)
			_ = s.ttrpc.Shutdown(sctx)
			cancel()
		} else {
			s.grpc.Stop()
		}
		_ = s.ttrpc.Close()
		s.closeListeners()
		if err := s.sn.Close(); err != nil {
			log.G(ctx).WithError(err).Warn("close snapshotter")
		}
	})
}

// startMemoryCollection starts collectMemory, every MemoryGCInterval, unless
// that is 0 or the server is stopping.
func (s *Server) startMemoryCollection(ctx context.Context) {
	iv := time.Duration(s.cfg.MemoryGCInterval)
	s.gcMu.Lock()
	defer s.gcMu.Unlock()
	if iv <= 0 || s.stopping || s.gcDone != nil {
		return
	}
	gctx, cancel := context.WithCancel(context.WithoutCancel(ctx))
	done := make(chan struct{})
	s.stopGC, s.gcDone = cancel, done
	go func() {
		defer close(done)
		s.collectMemory(gctx, iv)
	}()
}

// stopMemoryCollection stops the collection (one under way stops between
// families) and waits for it.
func (s *Server) stopMemoryCollection() {
	s.gcMu.Lock()
	s.stopping = true
	cancel, done := s.stopGC, s.gcDone
	s.gcMu.Unlock()
	if cancel != nil {
		cancel()
		<-done
	}
}

// collectMemory runs the memory store's GC at start and then every
// interval until Stop. Nothing else frees what a task that vanished without
// its shim's delete pinned (its bundle removed while its shim died): without
// this, only lazyfork gc would.
func (s *Server) collectMemory(ctx context.Context, interval time.Duration) {
	t := time.NewTicker(interval)
	defer t.Stop()
	for {
		freed, err := s.node.CollectMemory(ctx)
		l := log.G(ctx).WithField("lazyfork_root", s.node.Root())
		if err != nil && ctx.Err() == nil {
			l.WithError(err).WithField("next", interval).Warn("memory collection failed (lazyfork gc runs it at once)")
		}
		if len(freed) > 0 {
			l.WithField("freed", freed).Info("memory collection freed files no live task or snapshot held")
		}
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
	}
}

// Cancel cancels the calls in flight, making a graceful Stop finish now.
func (s *Server) Cancel() {
	s.grpc.Stop()
	_ = s.ttrpc.Close()
}

func (s *Server) closeListeners() {
	for _, l := range s.lns {
		l.Close()
		os.Remove(l.Addr().String())
	}
}

// listen binds a unix socket in a 0700 directory, replacing a stale socket
// but refusing to steal one that a live server answers on.
func listen(ctx context.Context, address string) (net.Listener, error) {
	if err := os.MkdirAll(filepath.Dir(address), 0o700); err != nil {
		return nil, err
	}
	if err := os.Chmod(filepath.Dir(address), 0o700); err != nil {
		return nil, err
	}
	if fi, err := os.Lstat(address); err == nil {
		if fi.Mode()&os.ModeSocket == 0 {
			return nil, fmt.Errorf("%s exists and is not a socket: %w", address, errdefs.ErrAlreadyExists)
		}
		if c, err := net.DialTimeout("unix", address, time.Second); err == nil {
			c.Close()
			return nil, fmt.Errorf("%s: another server is listening there: %w", address, errdefs.ErrAlreadyExists)
		}
		log.G(ctx).WithField("address", address).Info("removing stale socket")
		if err := os.Remove(address); err != nil {
			return nil, err
		}
	}
	l, err := net.Listen("unix", address)
	if err != nil {
		return nil, err
	}
	if err := os.Chmod(address, 0o600); err != nil {
		l.Close()
		return nil, err
	}
	return l, nil
}
