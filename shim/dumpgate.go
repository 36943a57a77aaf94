package shim

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	taskAPI "github.com/containerd/containerd/api/runtime/task/v3"
	"github.com/containerd/log"
	"golang.org/x/sys/unix"

	"github.com/lazyfork/lazyfork/internal/criuproxy"
)

// A checkpoint that moves its container onto a memory file again (a later
// fork: the move is a delta, tens of milliseconds) starts `runc checkpoint`
// at the move's start, not after it: runc's own start-up (7-10 ms: its Go
// runtime, its state, the version check the proxy answers) then runs beside
// the move instead of inside the pause after it. CRIU must not dump before
// the move is done, so the CRIU proxy holds it back at a gate
// (cmd/lazyfork-criu-proxy, wait_at_gate): a file named after the container,
// locked by the shim until the move is over, then holding "go" (the dump
// goes on) or anything else (it ends before CRIU starts, and runc fails). A
// shim that dies drops the lock with "go" never written. Only a proxy that
// knows gates gets one (criuproxy.HasGate); without the proxy, runc runs
// after the move as before.
//
// runc holds runc's shim's lock of the task while it runs, so a gate is
// held at most gateMaxHold: a move that takes longer has its early dump
// called off, and runc runs again after the move. (A first move copies the
// whole heap and gets no gate.)

// dumpGateEnv turns dump gates off ("off"): runc starts after the move.
const dumpGateEnv = "LAZYFORK_DUMP_GATE"

// gateMaxHold bounds how long a gate keeps runc (and with it every other
// call that needs the task's lock: state, kill, exec) waiting.
var gateMaxHold = time.Second

// gatePrefix is EnvGate's value once the proxy is set up with gates ("":
// none), the shim's own: an inherited environment is no proof of a proxy.
var gatePrefix atomic.Value

// gateLocks serializes the gates of one container (two checkpoints of it
// at once would share the file). An entry lives while a checkpoint holds or
// waits for it: a shim that serves thousands of containers keeps none of
// the gone ones.
var (
	gateLocksMu sync.Mutex
	gateLocks   = map[string]*gateLock{}
)

type gateLock struct {
	mu   sync.Mutex
	refs int // holders and waiters
}

// setupGates makes the gate directory in the proxy's cache directory,
// removes the gates of shims that are gone, and gives this shim's gates a
// prefix of its own there.
func setupGates(cacheDir, proxy string) (string, error) {
	ok, err := criuproxy.HasGate(proxy)
	if err != nil {
		return "", fmt.Errorf("read the CRIU proxy %s: %w", proxy, err)
	}
	if !ok {
		return "", fmt.Errorf("the CRIU proxy %s knows no dump gates: reinstall (make install)", proxy)
	}
	dir := filepath.Join(cacheDir, "gates")
	if err := os.Mkdir(dir, 0o700); err != nil && !os.IsExist(err) {
		return "", err
	}
	if err := checkOwnDir(dir, true); err != nil {
		return "", err
	}
	if ents, err := os.ReadDir(dir); err == nil {
		for _, e := range ents {
			pid, _, _ := strings.Cut(e.Name(), ".")
			if n, err := strconv.Atoi(pid); err == nil && n > 0 && unix.Kill(n, 0) == unix.ESRCH {
				os.Remove(filepath.Join(dir, e.Name()))
			}
		}
	}
	return filepath.Join(dir, strconv.Itoa(os.Getpid())) + ".", nil
}

// dumpGate is one closed gate.
type dumpGate struct {
	f      *os.File
	path   string
	unlock func()
	state  atomic.Int32 // gateClosed, then gateGo or gateAborted
	timer  *time.Timer
}

const (
	gateClosed int32 = iota
	gateGo
	gateAborted
)

// closeDumpGate closes the gate of container id's next dump, to be opened
// within gateMaxHold; ok is false when there are no gates (no proxy that
// knows them, or dumpGateEnv=off).
func closeDumpGate(id string) (g *dumpGate, ok bool, err error) {
	prefix, _ := gatePrefix.Load().(string)
	if prefix == "" || os.Getenv(dumpGateEnv) == "off" {
		removeStaleGate(id)
		return nil, false, nil
	}
	path := prefix + id
	unlock := lockGate(path)
	f, err := os.OpenFile(path, os.O_RDWR|os.O_CREATE|os.O_TRUNC|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0o600)
	if err != nil {
		unlock()
		return nil, false, fmt.Errorf("dump gate: %w", err)
	}
	if err := unix.Flock(int(f.Fd()), unix.LOCK_EX); err != nil {
		f.Close()
		os.Remove(path)
		unlock()
		return nil, false, fmt.Errorf("dump gate: lock %s: %w", path, err)
	}
	g = &dumpGate{f: f, path: path, unlock: unlock}
	g.timer = time.AfterFunc(gateMaxHold, func() { g.open(false) })
	return g, true, nil
}

// open lets the dump go on (proceed) or ends it before CRIU starts, once:
// it reports whether this call decided (a gate the timer called off stays
// called off). Closing the file drops the lock whatever the write did: a
// "go" not written ends the dump.
func (g *dumpGate) open(proceed bool) (decided bool, err error) {
	state, text := gateAborted, "abort"
	if proceed {
		state, text = gateGo, "go"
	}
	if !g.state.CompareAndSwap(gateClosed, state) {
		return false, nil
	}
	if _, err = g.f.WriteAt([]byte(text), 0); err != nil && proceed {
		g.state.Store(gateAborted) // the proxy reads no "go"
	}
	return true, errors.Join(err, g.f.Close())
}

// wentOn reports whether the dump was let go on.
func (g *dumpGate) wentOn() bool { return g.state.Load() == gateGo }

// remove deletes the gate once its dump is over (whatever became of it).
func (g *dumpGate) remove() {
	g.timer.Stop()
	g.open(false)
	os.Remove(g.path)
	g.unlock()
}

// lockGate takes the lock of the gate at path.
func lockGate(path string) (unlock func()) {
	gateLocksMu.Lock()
	l := gateLocks[path]
	if l == nil {
		l = &gateLock{}
		gateLocks[path] = l
	}
	l.refs++
	gateLocksMu.Unlock()
	l.mu.Lock()
	return func() {
		l.mu.Unlock()
		gateLocksMu.Lock()
		if l.refs--; l.refs == 0 {
			delete(gateLocks, path)
		}
		gateLocksMu.Unlock()
	}
}

// removeStaleGate deletes a gate of id that a killed shim of the same pid
// may have left, before a dump that runs without one.
func removeStaleGate(id string) {
	if prefix, _ := gatePrefix.Load().(string); prefix != "" {
		unlock := lockGate(prefix + id)
		os.Remove(prefix + id)
		unlock()
	}
}

// earlyDump is a `runc checkpoint` started before its move, its CRIU held at
// a gate. A nil *earlyDump is none: the dump runs after the move.
type earlyDump struct {
	gate   *dumpGate
	result chan error // runc's result, until taken
}

// startEarlyDump closes the gate of r's container and starts runc's
// checkpoint behind it; nil when there are no gates.
func (s *Service) startEarlyDump(ctx context.Context, r *taskAPI.CheckpointTaskRequest) *earlyDump {
	g, ok, err := closeDumpGate(r.ID)
	if err != nil {
		log.G(ctx).WithError(err).WithField("id", r.ID).Warn("lazyfork: runc checkpoint starts after the move")
	}
	if !ok {
		return nil
	}
	d := &earlyDump{gate: g, result: make(chan error, 1)}
	go func() {
		_, err := s.TTRPCTaskService.Checkpoint(ctx, r)
		d.result <- err
	}()
	return d
}

// dump runs r's dump with runc: early's, let go on now, or a new one.
func (s *Service) dump(ctx context.Context, r *taskAPI.CheckpointTaskRequest, early *earlyDump) error {
	if early != nil {
		_, gerr := early.gate.open(true)
		err := <-early.result
		early.result = nil
		if early.gate.wentOn() {
			return err
		}
		// Called off (the move outlasted gateMaxHold) or the gate
		// failed: that runc ended before CRIU; this one dumps.
		log.G(ctx).WithError(gerr).WithField("id", r.ID).Warn("lazyfork: the held-back dump was called off: runc runs again")
	}
	_, err := s.TTRPCTaskService.Checkpoint(ctx, r)
	return err
}

// wentOn reports whether the dump went on at its gate.
func (d *earlyDump) wentOn() bool { return d != nil && d.gate.wentOn() }

// close ends an early dump whose checkpoint returned before dumping (runc
// ends, CRIU never ran), waits for runc, and removes the gate.
func (d *earlyDump) close() {
	if d == nil {
		return
	}
	if d.result != nil {
		d.gate.open(false)
		<-d.result
	}
	d.gate.remove()
}
