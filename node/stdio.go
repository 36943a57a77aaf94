package node

import (
	"context"
	"errors"
	"fmt"
	"io"
	"sync"
	"sync/atomic"
	"time"

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

// relayChunk is the most data one message carries.
const relayChunk = 32 << 10

// Flow control: a side sends at most relayWindow data messages the other
// has not acknowledged, and acknowledges every relayAck it has passed on.
// ttrpc buffers 64 messages per stream and closes a stream whose reader
// stays that far behind for a second (ErrStreamFull); data, acks and the
// rest stay well under it.
const (
	relayWindow = 32
	relayAck    = 8
)

// credits is a window of messages a sender may still send.
type credits struct {
	c    chan struct{}
	stop <-chan struct{}
}

func newCredits(stop <-chan struct{}) *credits {
	c := &credits{c: make(chan struct{}, relayWindow), stop: stop}
	for range relayWindow {
		c.c <- struct{}{}
	}
	return c
}

// take waits for a credit; false once stop closes.
func (c *credits) take() bool {
	select {
	case <-c.c:
		return true
	case <-c.stop:
		return false
	}
}

// give returns n credits.
func (c *credits) give(n uint32) {
	for range n {
		select {
		case c.c <- struct{}{}:
		default:
		}
	}
}

// streamWriter sends what it is given as output of fd.
type streamWriter struct {
	mu     *sync.Mutex
	srv    pb.Stdio_RelayServer
	fd     int32
	credit *credits
}

func (w *streamWriter) Write(b []byte) (int, error) {
	for n := 0; n < len(b); {
		if !w.credit.take() {
			return n, io.ErrClosedPipe
		}
		m := min(len(b)-n, relayChunk)
		w.mu.Lock()
		err := w.srv.Send(&pb.StdioResponse{Fd: w.fd, Data: append([]byte(nil), b[n:n+m]...)})
		w.mu.Unlock()
		if err != nil {
			return n, err
		}
		n += m
	}
	return len(b), nil
}

// eofReader closes done when its reader ends: cio's copy into the stdin
// fifo has written everything before it reads the end.
type eofReader struct {
	r    io.Reader
	once sync.Once
	done chan struct{}
}

func (e *eofReader) Read(b []byte) (int, error) {
	n, err := e.r.Read(b)
	if err != nil {
		e.once.Do(func() { close(e.done) })
	}
	return n, err
}

// Relay makes the fifos the first request asks for, names them, then
// copies stdin in and the output out. It ends once both the output and
// stdin have ended, or when the client closes or goes.
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
	var mu sync.Mutex // serializes Send
	send := func(m *pb.StdioResponse) error {
		mu.Lock()
		defer mu.Unlock()
		return srv.Send(m)
	}
	stop := make(chan struct{})
	var stopOnce sync.Once
	halt := func() { stopOnce.Do(func() { close(stop) }) }
	defer halt()
	credit := newCredits(stop)

	// stdin: messages queue (never more than the client's window) for a
	// writer into the pipe cio copies into the fifo, so that reading the
	// stream never waits for the process.
	stdinDone := make(chan struct{})
	var stdinW *io.PipeWriter
	var queue chan *pb.StdioRequest
	opts := []cio.Opt{cio.WithFIFODir(dir)}
	var in io.Reader
	var out, errw io.Writer
	if req.Stdin {
		var stdinR *io.PipeReader
		stdinR, stdinW = io.Pipe()
		in = &eofReader{r: stdinR, done: stdinDone}
		queue = make(chan *pb.StdioRequest, 2*relayWindow)
	} else {
		close(stdinDone)
	}
	if req.Stdout {
		out = &streamWriter{mu: &mu, srv: srv, fd: 1, credit: credit}
	}
	if req.Stderr && !req.Terminal {
		errw = &streamWriter{mu: &mu, srv: srv, fd: 2, credit: credit}
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
	if err := send(&pb.StdioResponse{Stdin: cfg.Stdin, Stdout: cfg.Stdout, Stderr: cfg.Stderr}); err != nil {
		pio.Cancel()
		if stdinW != nil {
			stdinW.CloseWithError(err)
		}
		return err
	}

	if queue != nil {
		go func() {
			var passed uint32
			for m := range queue {
				if m == nil { // close_stdin
					stdinW.Close()
					return
				}
				if _, err := stdinW.Write(m.Data); err != nil {
					return // the process's stdin is gone; the rest is dropped
				}
				if passed++; passed == relayAck {
					if send(&pb.StdioResponse{Ack: passed}) != nil {
						return
					}
					passed = 0
				}
			}
		}()
	}
	gone := make(chan struct{})
	go func() {
		defer close(gone)
		closed := false
		for {
			m, err := srv.Recv()
			if err != nil {
				return
			}
			credit.give(m.Ack)
			if queue == nil || closed {
				continue
			}
			if len(m.Data) > 0 {
				select {
				case queue <- m:
				default: // past the window: the client ignores acks
					log.G(ctx).Warnf("stdio relay of %s: the client overran its window; stdin closed", req.Id)
					m.CloseStdin = true
				}
			}
			if m.CloseStdin {
				closed = true
				queue <- nil
			}
		}
	}()
	done := make(chan struct{})
	go func() { pio.Wait(); close(done) }()
	select {
	case <-done:
		if send(&pb.StdioResponse{OutputEnd: true}) == nil {
			select {
			case <-stdinDone:
				return nil
			case <-gone:
			case <-ctx.Done():
			}
		}
	case <-gone:
	case <-ctx.Done():
	}
	// The client closed or went away (its process exited, or it gave up):
	// stop copying; the process, if any, sees its fifos close as it would
	// with a local client's.
	halt()
	if stdinW != nil {
		stdinW.CloseWithError(io.ErrClosedPipe)
	}
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
		rio := &relayIO{cfg: cio.Config{Stdin: m.Stdin, Stdout: m.Stdout, Stderr: m.Stderr, Terminal: terminal}, st: st, cancel: cancel,
			halt: make(chan struct{})}
		rio.credit = newCredits(rio.halt)
		rio.outputEnd, rio.recvDone = make(chan struct{}), make(chan struct{})
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
	// outputEnd closes when the output has been written out.
	outputEnd chan struct{}
	endOnce   sync.Once
	// recvDone closes when the node has ended the stream.
	recvDone chan struct{}
	sendMu   sync.Mutex
	once     sync.Once
	// ended: the node ended the relay (nothing to close on its side).
	ended atomic.Bool
	// credit: stdin messages the node may still take; halt ends waits.
	credit *credits
	halt   chan struct{}
}

func (r *relayIO) Config() cio.Config { return r.cfg }

// Wait waits until the output has been copied.
func (r *relayIO) Wait() { <-r.outputEnd }

func (r *relayIO) endOutput() { r.endOnce.Do(func() { close(r.outputEnd) }) }

// Cancel stops the relay.
func (r *relayIO) Cancel() { r.stop() }

// Close stops the relay; the node removes the fifos.
func (r *relayIO) Close() error {
	r.stop()
	return nil
}

// stop closes the client's side and waits (briefly) for the node to end
// the stream, so that it is not cut mid-answer.
func (r *relayIO) stop() {
	r.once.Do(func() {
		close(r.halt)
		if !r.ended.Load() {
			r.sendMu.Lock()
			_ = r.st.CloseSend()
			r.sendMu.Unlock()
			select {
			case <-r.recvDone:
			case <-time.After(2 * time.Second):
			}
		}
		r.cancel()
	})
}

func (r *relayIO) output(stdout, stderr io.Writer) {
	defer close(r.recvDone)
	defer r.endOutput()
	var written uint32
	for {
		m, err := r.st.Recv()
		if err != nil {
			r.ended.Store(true)
			if !errors.Is(err, io.EOF) && !errors.Is(err, context.Canceled) {
				log.L.WithError(err).Debug("lazyfork: stdio relay ended")
			}
			return
		}
		r.credit.give(m.Ack)
		if m.OutputEnd {
			r.endOutput()
		}
		if len(m.Data) == 0 {
			continue
		}
		w := stdout
		if m.Fd == 2 {
			w = stderr
		}
		if w != nil {
			if _, err := w.Write(m.Data); err != nil {
				log.L.WithError(err).Debug("lazyfork: write relayed output")
			}
		}
		if written++; written == relayAck {
			_ = r.send(&pb.StdioRequest{Ack: written})
			written = 0
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
			if !r.credit.take() {
				return
			}
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
