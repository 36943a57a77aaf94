package node

import (
	"bytes"
	"context"
	"io"
	"net"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/containerd/ttrpc"

	pb "github.com/lazyfork/lazyfork/proto/lazyfork/v1"
)

// syncBuffer is a bytes.Buffer safe for the relay's goroutine.
type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

// serveStdio serves a StdioService (fifos under dir/fifo) on dir/api.sock.
func serveStdio(t *testing.T) (sock, fifoDir string) {
	t.Helper()
	dir := t.TempDir()
	sock, fifoDir = filepath.Join(dir, "api.sock"), filepath.Join(dir, "fifo")
	srv, err := ttrpc.NewServer()
	if err != nil {
		t.Fatal(err)
	}
	pb.RegisterStdioService(srv, &StdioService{FIFODir: fifoDir})
	l, err := net.Listen("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	go srv.Serve(context.Background(), l)
	t.Cleanup(func() { srv.Close() })
	return sock, fifoDir
}

// waitEmpty waits until dir holds nothing (the relay removed its fifos).
func waitEmpty(t *testing.T, dir string) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for {
		ents, err := os.ReadDir(dir)
		if (err == nil && len(ents) == 0) || os.IsNotExist(err) {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("fifos left in %s: %v", dir, ents)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// TestStdioRelay: a process's stdin, stdout and stderr cross the API as
// containerd's shim sees them: fifos on the node, opened by the paths the
// client was given; the client's Wait returns once the output is copied,
// and the fifos are gone after.
func TestStdioRelay(t *testing.T) {
	sock, fifoDir := serveStdio(t)
	r := NewRemote(sock)
	defer r.Close()
	var out, errb syncBuffer
	pio, err := r.IO(strings.NewReader("to the process\n"), &out, &errb, false)("exec-1")
	if err != nil {
		t.Fatal(err)
	}
	cfg := pio.Config()
	for _, p := range []string{cfg.Stdin, cfg.Stdout, cfg.Stderr} {
		if !strings.HasPrefix(p, fifoDir+"/") {
			t.Fatalf("fifo %q not under the node's fifo directory %s", p, fifoDir)
		}
		if st, err := os.Stat(p); err != nil || st.Mode()&os.ModeNamedPipe == 0 {
			t.Fatalf("%s is not a fifo: %v", p, err)
		}
	}
	// The shim's side: read stdin to its end, write the output.
	in, err := os.OpenFile(cfg.Stdin, os.O_RDONLY, 0)
	if err != nil {
		t.Fatal(err)
	}
	got, err := io.ReadAll(in)
	in.Close()
	if err != nil || string(got) != "to the process\n" {
		t.Fatalf("the process read %q (%v)", got, err)
	}
	for p, s := range map[string]string{cfg.Stdout: strings.Repeat("o", 100<<10), cfg.Stderr: "err\n"} {
		f, err := os.OpenFile(p, os.O_WRONLY, 0)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := f.WriteString(s); err != nil {
			t.Fatal(err)
		}
		f.Close()
	}
	pio.Wait()
	if out.String() != strings.Repeat("o", 100<<10) || errb.String() != "err\n" {
		t.Errorf("relayed stdout %d bytes, stderr %q", len(out.String()), errb.String())
	}
	pio.Close()
	waitEmpty(t, fifoDir)
}

// TestStdioRelayTerminal: a terminal has stdin and stdout only.
func TestStdioRelayTerminal(t *testing.T) {
	sock, fifoDir := serveStdio(t)
	r := NewRemote(sock)
	defer r.Close()
	var out syncBuffer
	pio, err := r.IO(nil, &out, &out, true)("tty")
	if err != nil {
		t.Fatal(err)
	}
	cfg := pio.Config()
	if !cfg.Terminal || cfg.Stdin != "" || cfg.Stderr != "" || cfg.Stdout == "" {
		t.Fatalf("terminal config %+v", cfg)
	}
	f, err := os.OpenFile(cfg.Stdout, os.O_WRONLY, 0)
	if err != nil {
		t.Fatal(err)
	}
	f.WriteString("$ ")
	f.Close()
	pio.Wait()
	if out.String() != "$ " {
		t.Errorf("relayed %q", out.String())
	}
	pio.Close()
	waitEmpty(t, fifoDir)
}

// TestStdioRelayCancel: a client that gives up before the process opens its
// fifos (a failed exec) ends the relay; the node removes the fifos.
func TestStdioRelayCancel(t *testing.T) {
	sock, fifoDir := serveStdio(t)
	r := NewRemote(sock)
	defer r.Close()
	pio, err := r.IO(strings.NewReader("x"), io.Discard, io.Discard, false)("never")
	if err != nil {
		t.Fatal(err)
	}
	if ents, _ := os.ReadDir(fifoDir); len(ents) != 1 {
		t.Fatalf("fifo dirs: %v", ents)
	}
	pio.Cancel()
	pio.Wait()
	pio.Close()
	waitEmpty(t, fifoDir)
}

// TestStdioRelayNoServer: without the API the creator fails, naming it.
func TestStdioRelayNoServer(t *testing.T) {
	sock := filepath.Join(t.TempDir(), "none.sock")
	_, err := NewRemote(sock).IO(nil, io.Discard, nil, false)("p")
	if err == nil || !strings.Contains(err.Error(), sock) {
		t.Fatalf("err = %v", err)
	}
}

// slowWriter blocks its first write for a while: a consumer (a pager, a
// slow pipe) that does not read.
type slowWriter struct {
	syncBuffer
	once sync.Once
}

func (s *slowWriter) Write(p []byte) (int, error) {
	s.once.Do(func() { time.Sleep(2500 * time.Millisecond) })
	return s.syncBuffer.Write(p)
}

// TestStdioRelaySlowEnds: a consumer of the output that stalls for
// seconds, and a process that reads its stdin only seconds later, lose
// nothing: the relay holds back rather than overrun ttrpc's stream buffers
// (which close a stream whose reader falls 64 messages behind for a second).
func TestStdioRelaySlowEnds(t *testing.T) {
	sock, fifoDir := serveStdio(t)
	r := NewRemote(sock)
	defer r.Close()
	const size = 8 << 20
	in := bytes.Repeat([]byte("0123456789abcdef"), size/16)
	out := &slowWriter{}
	pio, err := r.IO(bytes.NewReader(in), out, io.Discard, false)("slow")
	if err != nil {
		t.Fatal(err)
	}
	cfg := pio.Config()
	got := make(chan []byte, 1)
	go func() {
		time.Sleep(2500 * time.Millisecond) // the process reads late
		f, err := os.OpenFile(cfg.Stdin, os.O_RDONLY, 0)
		if err != nil {
			got <- nil
			return
		}
		b, _ := io.ReadAll(f)
		f.Close()
		got <- b
	}()
	f, err := os.OpenFile(cfg.Stdout, os.O_WRONLY, 0)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := f.Write(in); err != nil {
		t.Fatal(err)
	}
	f.Close()
	ef, err := os.OpenFile(cfg.Stderr, os.O_WRONLY, 0)
	if err != nil {
		t.Fatal(err)
	}
	ef.Close()
	pio.Wait()
	if b := <-got; !bytes.Equal(b, in) {
		t.Errorf("the process read %d of %d bytes of stdin", len(b), len(in))
	}
	if o := out.String(); o != string(in) {
		t.Errorf("relayed %d of %d bytes of output", len(o), len(in))
	}
	pio.Close()
	waitEmpty(t, fifoDir)
}

// TestStdioRelayStdinUnread: a process that never reads its stdin (and
// exits) does not hold the relay: the output ends, the client closes, the
// node removes the fifos.
func TestStdioRelayStdinUnread(t *testing.T) {
	sock, fifoDir := serveStdio(t)
	r := NewRemote(sock)
	defer r.Close()
	pr, pw := io.Pipe() // stdin that never ends
	defer pw.Close()
	go pw.Write(bytes.Repeat([]byte("x"), 1<<20))
	var out syncBuffer
	pio, err := r.IO(pr, &out, io.Discard, false)("unread")
	if err != nil {
		t.Fatal(err)
	}
	cfg := pio.Config()
	for _, p := range []string{cfg.Stdout, cfg.Stderr} {
		f, err := os.OpenFile(p, os.O_WRONLY, 0)
		if err != nil {
			t.Fatal(err)
		}
		f.WriteString("bye")
		f.Close()
	}
	pio.Wait()
	pio.Close()
	if out.String() != "bye" {
		t.Errorf("relayed %q", out.String())
	}
	waitEmpty(t, fifoDir)
}
