// Command agent is a small program for a LazyFork container that uses the
// runtime hook (package hook): each copy of it draws different random
// numbers after a fork, and re-establishes its connection.
//
//	agent [--connect ADDR] [--interval D]
//
// It listens on $LAZYFORK_HOOK (/run/lazyfork-hook/hook.sock by default).
// On QUIESCE it closes its connection (a live connection cannot be copied);
// on RESEED <id> it reseeds its random state from the kernel, names itself id
// and reconnects. It prints one line per event:
//
//	agent start seed=S
//	tick N id=ID rand=R
//	quiesce
//	reseed id=ID seed=S
//
// Run it in a LazyFork container created with a hook:
//
//	CGO_ENABLED=0 go build -o /usr/local/lib/lazyfork/agent ./examples/agent
//	lazyfork create --name agent --hook /run/lazyfork/hooks IMAGE -- /agent
//
// (the image must hold the binary; a static Go build runs in busybox).
package main

import (
	"context"
	crand "crypto/rand"
	"encoding/binary"
	"flag"
	"fmt"
	"math/rand/v2"
	"net"
	"os"
	"sync"
	"time"

	"github.com/lazyfork/lazyfork/hook"
)

type agent struct {
	mu   sync.Mutex
	id   string
	rng  *rand.Rand
	addr string
	conn net.Conn
	tick int
}

func seed() uint64 {
	var b [8]byte
	if _, err := crand.Read(b[:]); err != nil {
		panic(err)
	}
	return binary.LittleEndian.Uint64(b[:])
}

func (a *agent) reseed() uint64 {
	s := seed()
	a.rng = rand.New(rand.NewPCG(s, s^0x9e3779b97f4a7c15))
	return s
}

func (a *agent) connect() {
	if a.addr == "" || a.conn != nil {
		return
	}
	network := "tcp"
	if len(a.addr) > 0 && a.addr[0] == '/' {
		network = "unix"
	}
	if c, err := net.DialTimeout(network, a.addr, time.Second); err == nil {
		a.conn = c
	} else {
		fmt.Printf("connect %s: %v\n", a.addr, err)
	}
}

func (a *agent) Quiesce(context.Context) error {
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.conn != nil {
		a.conn.Close()
		a.conn = nil
	}
	fmt.Println("quiesce")
	return nil
}

func (a *agent) Reseed(_ context.Context, id string) error {
	a.mu.Lock()
	defer a.mu.Unlock()
	s := a.reseed()
	a.id = id
	fmt.Printf("reseed id=%s seed=%d\n", id, s)
	a.connect()
	return nil
}

func main() {
	addr := flag.String("connect", "", "address to keep a connection to (host:port or a unix socket path)")
	interval := flag.Duration("interval", 100*time.Millisecond, "tick interval")
	flag.Parse()
	a := &agent{addr: *addr, id: os.Getenv("HOSTNAME")}
	s := a.reseed()
	fmt.Printf("agent start seed=%d\n", s)
	srv, err := hook.Listen(hook.SocketPath(), a)
	if err != nil {
		fmt.Fprintln(os.Stderr, "agent:", err)
		os.Exit(1)
	}
	go srv.Serve()
	a.mu.Lock()
	a.connect()
	a.mu.Unlock()
	for {
		time.Sleep(*interval)
		a.mu.Lock()
		a.tick++
		fmt.Printf("tick %d id=%s rand=%d\n", a.tick, a.id, a.rng.Uint64())
		if a.conn != nil {
			fmt.Fprintf(a.conn, "tick %d id=%s\n", a.tick, a.id)
		}
		a.mu.Unlock()
	}
}
