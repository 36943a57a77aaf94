//go:build linux

package node

import (
	"bytes"
	"context"
	"io"
	"net"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/containerd/log"
	"github.com/containerd/ttrpc"

	pb "github.com/lazyfork/lazyfork/proto/lazyfork/v1"
)

// TestReadLogSlowReader: a reader of a large log that stalls for seconds
// (lazyfork logs NAME | less) gets all of it through the API: the server
// keeps within the reader's window instead of overrunning ttrpc's stream
// buffer (which cut such a read at about 4 MiB with "stream buffer full").
func TestReadLogSlowReader(t *testing.T) {
	dir := t.TempDir()
	logp := filepath.Join(dir, "big.log")
	want := bytes.Repeat([]byte("0123456789abcdef"), 1<<20) // 16 MiB
	if err := os.WriteFile(logp, want, 0o644); err != nil {
		t.Fatal(err)
	}
	r := serveNode(t, dir)
	lr, err := r.ReadLog(context.Background(), logp, false)
	if err != nil {
		t.Fatal(err)
	}
	defer lr.Close()
	first := make([]byte, 100)
	if _, err := io.ReadFull(lr, first); err != nil {
		t.Fatal(err)
	}
	time.Sleep(2500 * time.Millisecond)
	rest, err := io.ReadAll(lr)
	if err != nil {
		t.Fatalf("after a stall: %v (read %d)", err, 100+len(rest))
	}
	if got := append(first, rest...); !bytes.Equal(got, want) {
		t.Errorf("read %d of %d bytes", len(got), len(want))
	}
}

// TestReadLogCloseEarly: a reader that stops after its first bytes (lazyfork
// logs NAME | head, or grep -q) closes the stream without ttrpc logging the
// chunks still in flight as errors on the user's terminal, and the node
// stops sending.
func TestReadLogCloseEarly(t *testing.T) {
	dir := t.TempDir()
	logp := filepath.Join(dir, "big.log")
	if err := os.WriteFile(logp, bytes.Repeat([]byte("0123456789abcdef"), 1<<20), 0o644); err != nil {
		t.Fatal(err)
	}
	var logged bytes.Buffer
	out := log.L.Logger.Out
	log.L.Logger.SetOutput(&logged)
	defer log.L.Logger.SetOutput(out)
	r := serveNode(t, dir)
	for _, follow := range []bool{false, true} {
		lr, err := r.ReadLog(context.Background(), logp, follow)
		if err != nil {
			t.Fatal(err)
		}
		first := make([]byte, 100)
		if _, err := io.ReadFull(lr, first); err != nil {
			t.Fatal(err)
		}
		t0 := time.Now()
		lr.Close()
		if took := time.Since(t0); took >= closeDrain {
			t.Errorf("follow %v: Close waited %v: the node did not end the stream", follow, took)
		}
	}
	time.Sleep(200 * time.Millisecond) // anything still in flight arrives
	if bytes.Contains(logged.Bytes(), []byte("inactive stream")) {
		t.Errorf("closing early logged errors:\n%s", logged.String())
	}
}

// serveNode serves a local node's API from dir and returns a client of it.
func serveNode(t *testing.T, dir string) *Remote {
	t.Helper()
	srv, err := ttrpc.NewServer()
	if err != nil {
		t.Fatal(err)
	}
	pb.RegisterNodeService(srv, &Service{N: NewLocal(filepath.Join(dir, "root"))})
	l, err := net.Listen("unix", filepath.Join(dir, "api.sock"))
	if err != nil {
		t.Fatal(err)
	}
	go srv.Serve(context.Background(), l)
	t.Cleanup(func() { srv.Close() })
	r := NewRemote(filepath.Join(dir, "api.sock"))
	t.Cleanup(func() { r.Close() })
	return r
}
