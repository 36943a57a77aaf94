package node

import (
	"context"
	"errors"
	"fmt"
	"io"
	"sync"
	"sync/atomic"

	"github.com/containerd/containerd/v2/defaults"
	"github.com/containerd/containerd/v2/pkg/cio"
	"github.com/containerd/errdefs"
	"github.com/containerd/log"

	pb "github.com/lazyfork/lazyfork/proto/lazyfork/v1"
)

// A process's standard streams cross the node API (lazyfork.v1.Stdio) as
// one stream per process: containerd's shim opens fifos by path, so a
// client that does not share the node's filesystem (a Mac driving a Lima
// VM, another mount namespace) has the node make the fifos and relay them.
// On the node StdioService uses containerd's own cio (the same fifos and
// copies a local client makes); Remote.IO is the client's cio.Creator.

// StdioService serves lazyfork.v1.Stdio: it makes a process's fifos under
// FIFODir (containerd's default fifo directory if empty) and relays them.
type StdioService struct {
	FIFODir string
}

var _ pb.StdioService = (*StdioService)(nil)

// relayChunk is the size of the output messages.
const relayChunk = 32 << 10

// streamWriter sends what it is given as output of fd.
type streamWriter struct {
	mu  *sync.Mutex
	srv pb.Stdio_RelayServer
	fd  int32
}

func (w *streamWriter) Write(b []byte) (int, error) {
	w.mu.Lock()
	defer w.mu.Unlock()
	for n := 0; n < len(b); {
		m := min(len(b)-n, relayChunk)
		if err := w.srv.Send(&pb.StdioResponse{Fd: w.fd, Data: append([]byte(nil), b[n:n+m]...)}); err != nil {
			return n, err
		}
		n += m
	}
	return len(b), nil
}

// Relay makes the fifos the first request asks for, names them, then
// copies stdin in and the output out until the outputs end or the client
// goes.
func (s *StdioService) Relay(ctx context.Context, srv pb.Stdio_RelayServer) error {
	req, err := srv.Recv()
	if err != nil {
		return err
	}
	if req.Id == "" {
		return toGRPC(fmt.Errorf("stdio relay: no process id: %w", errdefs.ErrInvalidArgument))
	}
	dir := s.FIFODir
	if dir == "" {
		dir = defaults.DefaultFIFODir
	}
	var mu sync.Mutex
	var stdinR *io.PipeReader
	var stdinW *io.PipeWriter
	opts := []cio.Opt{cio.WithFIFODir(dir)}
	var in io.Reader
	var out, errw io.Writer
	if req.Stdin {
		stdinR, stdinW = io.Pipe()
		in = stdinR
	}
	if req.Stdout {
		out = &streamWriter{mu: &mu, srv: srv, fd: 1}
	}
	if req.Stderr && !req.Terminal {
		errw = &streamWriter{mu: &mu, srv: srv, fd: 2}
	}
	opts = append(opts, cio.WithStreams(in, out, errw))
	if req.Terminal {
		opts = append(opts, cio.WithTerminal)
	}
	pio, err := cio.NewCreator(opts...)(req.Id)
	if err != nil {
		if stdinW != nil {
			stdinW.Close()
		}
		return toGRPC(fmt.Errorf("stdio relay of %s: fifos in %s: %w", req.Id, dir, err))
	}
	defer pio.Close() // closes the fifos, removes their directory
	cfg := pio.Config()
	mu.Lock()
	err = srv.Send(&pb.StdioResponse{Stdin: cfg.Stdin, Stdout: cfg.Stdout, Stderr: cfg.Stderr})
	mu.Unlock()
	if err != nil {
		pio.Cancel()
		if stdinW != nil {
			stdinW.CloseWithError(err)
		}
		return err
	}

	gone := make(chan struct{})
	go func() {
		defer close(gone)
		for {
			m, err := srv.Recv()
			if err != nil {
				if stdinW != nil {
					stdinW.CloseWithError(io.ErrClosedPipe)
				}
				return
			}
			if stdinW == nil {
				continue
			}
			if len(m.Data) > 0 {
				if _, err := stdinW.Write(m.Data); err != nil {
					log.G(ctx).WithError(err).Debugf("stdio relay of %s: stdin", req.Id)
				}
			}
			if m.CloseStdin {
				stdinW.Close()
			}
		}
	}()
	done := make(chan struct{})
	go func() { pio.Wait(); close(done) }()
	select {
	case <-done:
		return nil
	case <-gone:
	case <-ctx.Done():
	}
	// The client went away: stop copying (the process, if any, sees its
	// fifos close as it would with a local client's).
	pio.Cancel()
	<-done
	return nil
}

// IO is a cio.Creator for a process whose stdio the node relays: the fifos
// are the node's, named by the node API's Stdio service, and the streams
// cross the API socket. Pass it to containerd's NewTask or Exec as a local
// client passes cio.NewCreator.
func (r *Remote) IO(stdin io.Reader, stdout, stderr io.Writer, terminal bool) cio.Creator {
	return func(id string) (cio.IO, error) {
		c, err := r.stdioClient()
		if err != nil {
			return nil, err
		}
		ctx, cancel := context.WithCancel(context.Background())
		st, err := c.Relay(ctx)
		if err != nil {
			cancel()
			return nil, fromGRPC(err)
		}
		first := &pb.StdioRequest{Id: id, Terminal: terminal, Stdin: stdin != nil, Stdout: stdout != nil, Stderr: stderr != nil && !terminal}
		if err := st.Send(first); err != nil {
			cancel()
			return nil, fromGRPC(err)
		}
		m, err := st.Recv()
		if err != nil {
			cancel()
			err = fromGRPC(err)
			if errdefs.IsNotImplemented(err) {
				return nil, fmt.Errorf("the LazyFork API at %s relays no stdio (an older lazyfork-snapshotter): update it on the node: %w", r.socket, err)
			}
			return nil, fmt.Errorf("stdio of %s through the LazyFork API at %s: %w", id, r.socket, err)
		}
		rio := &relayIO{cfg: cio.Config{Stdin: m.Stdin, Stdout: m.Stdout, Stderr: m.Stderr, Terminal: terminal}, st: st, cancel: cancel}
		rio.wg.Add(1)
		go rio.output(stdout, stderr)
		if stdin != nil {
			go rio.input(stdin)
		}
		return rio, nil
	}
}

// stdioClient is the Stdio client on the API's connection.
func (r *Remote) stdioClient() (pb.StdioClient, error) {
	if _, err := r.client(); err != nil {
		return nil, err
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.conn == nil {
		return nil, fmt.Errorf("LazyFork API at %s: connection closed: %w", r.socket, errdefs.ErrUnavailable)
	}
	return pb.NewStdioClient(r.conn), nil
}

// relayIO is a process's stdio relayed by the node (cio.IO).
type relayIO struct {
	cfg    cio.Config
	st     pb.Stdio_RelayClient
	cancel context.CancelFunc
	wg     sync.WaitGroup
	sendMu sync.Mutex
	once   sync.Once
	// ended: the node ended the relay (nothing to close on its side).
	ended atomic.Bool
}

func (r *relayIO) Config() cio.Config { return r.cfg }

// Wait waits until the output has been copied (the node ended the relay).
func (r *relayIO) Wait() { r.wg.Wait() }

// Cancel stops the relay.
func (r *relayIO) Cancel() { r.stop() }

// Close stops the relay; the node removes the fifos.
func (r *relayIO) Close() error {
	r.stop()
	return nil
}

func (r *relayIO) stop() {
	r.once.Do(func() {
		if !r.ended.Load() {
			r.sendMu.Lock()
			_ = r.st.CloseSend()
			r.sendMu.Unlock()
		}
		r.cancel()
	})
}

func (r *relayIO) output(stdout, stderr io.Writer) {
	defer r.wg.Done()
	for {
		m, err := r.st.Recv()
		if err != nil {
			r.ended.Store(true)
			if !errors.Is(err, io.EOF) && !errors.Is(err, context.Canceled) {
				log.L.WithError(err).Debug("lazyfork: stdio relay ended")
			}
			return
		}
		w := stdout
		if m.Fd == 2 {
			w = stderr
		}
		if w != nil && len(m.Data) > 0 {
			if _, err := w.Write(m.Data); err != nil {
				log.L.WithError(err).Debug("lazyfork: write relayed output")
			}
		}
	}
}

func (r *relayIO) send(m *pb.StdioRequest) error {
	if r.ended.Load() {
		return io.ErrClosedPipe
	}
	r.sendMu.Lock()
	defer r.sendMu.Unlock()
	return r.st.Send(m)
}

func (r *relayIO) input(stdin io.Reader) {
	buf := make([]byte, relayChunk)
	for {
		n, err := stdin.Read(buf)
		if n > 0 {
			if serr := r.send(&pb.StdioRequest{Data: append([]byte(nil), buf[:n]...)}); serr != nil {
				return
			}
		}
		if err != nil {
			_ = r.send(&pb.StdioRequest{CloseStdin: true})
			return
		}
	}
}

// StdioRelay is a Node that relays processes' stdio (Remote does).
type StdioRelay interface {
	IO(stdin io.Reader, stdout, stderr io.Writer, terminal bool) cio.Creator
}

var _ StdioRelay = (*Remote)(nil)
