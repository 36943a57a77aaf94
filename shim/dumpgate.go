package shim

import (
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"sync/atomic"

	"golang.org/x/sys/unix"

	"github.com/lazyfork/lazyfork/internal/criuproxy"
)

// A checkpoint that moves its container onto a memory file first starts
// `runc checkpoint` at the move's start, not after it: runc's own start-up
// (7-10 ms: its Go runtime, its state, the version check the proxy answers)
// then runs beside the move instead of inside the pause after it. CRIU must
// not dump before the move is done, so the CRIU proxy holds it back at a
// gate (cmd/lazyfork-criu-proxy, wait_at_gate): a file named after the
// container, locked by the shim until the move is over, then holding "go"
// (the dump goes on) or anything else (it ends before CRIU starts, and runc
// fails). A shim that dies unlocks it with "go" never written. Only a proxy
// that knows gates gets one (criuproxy.HasGate); without the proxy, runc
// runs after the move as before.

// gatePrefix is EnvGate's value once the proxy is set up with gates ("":
// none), the shim's own: an inherited environment is no proof of a proxy.
var gatePrefix atomic.Value

// setupGates makes the gate directory in the proxy's cache directory and
// gives this shim's gates a prefix of its own there.
func setupGates(cacheDir, proxy string) (string, error) {
	ok, err := criuproxy.HasGate(proxy)
	if err != nil || !ok {
		return "", fmt.Errorf("the CRIU proxy %s knows no dump gates (%v): reinstall (make install)", proxy, err)
	}
	dir := filepath.Join(cacheDir, "gates")
	if err := os.Mkdir(dir, 0o700); err != nil && !os.IsExist(err) {
		return "", err
	}
	if err := checkOwnDir(dir, false); err != nil {
		return "", err
	}
	return filepath.Join(dir, strconv.Itoa(os.Getpid())) + ".", nil
}

// dumpGate is one closed gate.
type dumpGate struct {
	f    *os.File
	path string
}

// dumpGateEnv turns dump gates off ("off"): runc starts after the move.
const dumpGateEnv = "LAZYFORK_DUMP_GATE"

// closeDumpGate closes the gate of container id's next dump; ok is false
// when there are no gates (no proxy that knows them, or dumpGateEnv=off).
func closeDumpGate(id string) (g *dumpGate, ok bool, err error) {
	prefix, _ := gatePrefix.Load().(string)
	if prefix == "" || os.Getenv(dumpGateEnv) == "off" {
		removeStaleGate(id)
		return nil, false, nil
	}
	path := prefix + id
	f, err := os.OpenFile(path, os.O_RDWR|os.O_CREATE|os.O_TRUNC|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0o600)
	if err != nil {
		return nil, false, fmt.Errorf("dump gate: %w", err)
	}
	if err := unix.Flock(int(f.Fd()), unix.LOCK_EX); err != nil {
		f.Close()
		os.Remove(path)
		return nil, false, fmt.Errorf("dump gate: lock %s: %w", path, err)
	}
	return &dumpGate{f: f, path: path}, true, nil
}

// open lets the dump go on (proceed) or ends it before CRIU starts. It
// unlocks the gate whatever happens: a "go" not written ends the dump.
func (g *dumpGate) open(proceed bool) error {
	state := []byte("abort")
	if proceed {
		state = []byte("go")
	}
	err := g.f.Truncate(0)
	if err == nil {
		_, err = g.f.WriteAt(state, 0)
	}
	if uerr := unix.Flock(int(g.f.Fd()), unix.LOCK_UN); err == nil {
		err = uerr
	}
	return err
}

// remove deletes the gate once its dump is over (whatever became of it).
func (g *dumpGate) remove() {
	g.f.Close()
	os.Remove(g.path)
}

// removeStaleGate deletes a gate of id that a killed shim of the same pid
// may have left, before a dump that runs without one.
func removeStaleGate(id string) {
	if prefix, _ := gatePrefix.Load().(string); prefix != "" {
		os.Remove(prefix + id)
	}
}
