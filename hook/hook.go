package hook

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"time"
)

// EnvSocket is the variable that tells the program in the container where to listen.
const EnvSocket = "LAZYFORK_HOOK"

// ContainerDir is where the hook directory is mounted in the container.
const ContainerDir = "/run/lazyfork-hook"

// SocketName is the socket's name inside the hook directory.
const SocketName = "hook.sock"

// DefaultTimeout bounds how long LazyFork waits for an answer.
const DefaultTimeout = 5 * time.Second

// Handler is what a runtime implements.
type Handler interface {
	// Quiesce is called before a snapshot; the snapshot waits for it.
	Quiesce(ctx context.Context) error
	// Reseed is called in a restored copy with its container id.
	Reseed(ctx context.Context, id string) error
}

// Funcs adapts two functions to a Handler; nil ones do nothing.
type Funcs struct {
	OnQuiesce func(ctx context.Context) error
	OnReseed  func(ctx context.Context, id string) error
}

var _ Handler = Funcs{}

func (f Funcs) Quiesce(ctx context.Context) error {
	if f.OnQuiesce == nil {
		return nil
	}
	return f.OnQuiesce(ctx)
}

func (f Funcs) Reseed(ctx context.Context, id string) error {
	if f.OnReseed == nil {
		return nil
	}
	return f.OnReseed(ctx, id)
}

// SocketPath is $LAZYFORK_HOOK, or ContainerDir/SocketName.
func SocketPath() string {
	if p := os.Getenv(EnvSocket); p != "" {
		return p
	}
	return filepath.Join(ContainerDir, SocketName)
}

// HostSocket is the host path of container id's hook socket under dir (the
// value of the api.LabelHook label).
func HostSocket(dir, id string) string { return filepath.Join(dir, id, SocketName) }

// Server answers LazyFork's messages on a unix socket.
type Server struct {
	ln     net.Listener
	h      Handler
	mu     sync.Mutex
	closed bool
}

// Listen binds path (removing a stale socket left there) and returns a
// server; call Serve to answer.
func Listen(path string, h Handler) (*Server, error) {
	if fi, err := os.Lstat(path); err == nil && fi.Mode()&os.ModeSocket != 0 {
		os.Remove(path)
	}
	ln, err := net.Listen("unix", path)
	if err != nil {
		return nil, fmt.Errorf("hook: listen %s: %w", path, err)
	}
	return &Server{ln: ln, h: h}, nil
}

// Serve answers connections one at a time until Close.
func (s *Server) Serve() error {
	for {
		c, err := s.ln.Accept()
		if err != nil {
			s.mu.Lock()
			closed := s.closed
			s.mu.Unlock()
			if closed {
				return nil
			}
			var ne net.Error
			if errors.As(err, &ne) && ne.Timeout() {
				continue
			}
			// A restored listener may report a transient error once; keep serving.
			time.Sleep(10 * time.Millisecond)
			continue
		}
		s.handle(c)
	}
}

func (s *Server) handle(c net.Conn) {
	defer c.Close()
	_ = c.SetDeadline(time.Now().Add(time.Minute))
	line, err := bufio.NewReader(c).ReadString('\n')
	if err != nil {
		return
	}
	ctx := context.Background()
	cmd, arg, _ := strings.Cut(strings.TrimSpace(line), " ")
	switch cmd {
	case "QUIESCE":
		err = s.h.Quiesce(ctx)
	case "RESEED":
		if arg == "" {
			err = errors.New("RESEED needs an id")
		} else {
			err = s.h.Reseed(ctx, arg)
		}
	default:
		err = fmt.Errorf("unknown message %q", cmd)
	}
	if err != nil {
		fmt.Fprintf(c, "ERR %s\n", strings.ReplaceAll(err.Error(), "\n", " "))
		return
	}
	fmt.Fprint(c, "OK\n")
}

// Close stops the server and removes its socket.
func (s *Server) Close() error {
	s.mu.Lock()
	s.closed = true
	s.mu.Unlock()
	return s.ln.Close()
}

// Quiesce asks the runtime listening at socket to quiesce and waits at most
// timeout (0: DefaultTimeout) for its answer.
func Quiesce(ctx context.Context, socket string, timeout time.Duration) error {
	return send(ctx, socket, "QUIESCE", timeout)
}

// Reseed tells the runtime listening at socket that it is now copy id.
func Reseed(ctx context.Context, socket, id string, timeout time.Duration) error {
	return send(ctx, socket, "RESEED "+id, timeout)
}

func send(ctx context.Context, socket, msg string, timeout time.Duration) error {
	if timeout <= 0 {
		timeout = DefaultTimeout
	}
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	var d net.Dialer
	var c net.Conn
	var err error
	// A just-restored copy may not have its socket in place for a moment.
	for {
		c, err = d.DialContext(ctx, "unix", socket)
		if err == nil || ctx.Err() != nil {
			break
		}
		select {
		case <-ctx.Done():
		case <-time.After(20 * time.Millisecond):
		}
	}
	if err != nil {
		return fmt.Errorf("hook %s: %s: %w", socket, msg, err)
	}
	defer c.Close()
	dl, _ := ctx.Deadline()
	_ = c.SetDeadline(dl)
	if _, err := fmt.Fprintf(c, "%s\n", msg); err != nil {
		return fmt.Errorf("hook %s: %s: %w", socket, msg, err)
	}
	r := bufio.NewReader(c)
	line, err := r.ReadString('\n')
	if err != nil {
		return fmt.Errorf("hook %s: %s: no answer: %w", socket, msg, err)
	}
	// Wait for the runtime to close its end, so no connection is open when
	// the caller pauses the container.
	_, _ = r.ReadString('\n')
	line = strings.TrimSpace(line)
	if line != "OK" {
		return fmt.Errorf("hook %s: %s: runtime answered %q", socket, msg, line)
	}
	return nil
}
