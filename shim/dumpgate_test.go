package shim

import (
	"os"
	"path/filepath"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// withGates points the shim's gates at a directory of the test's.
func withGates(t *testing.T) string {
	t.Helper()
	old, _ := gatePrefix.Load().(string)
	prefix := filepath.Join(t.TempDir(), "1.")
	gatePrefix.Store(prefix)
	t.Cleanup(func() { gatePrefix.Store(old) })
	return prefix
}

// gateState is what a proxy would find at the gate: whether its lock is
// free now, and what the file holds ("" when there is no file).
func gateState(t *testing.T, path string) (free bool, content string) {
	t.Helper()
	f, err := os.Open(path)
	if os.IsNotExist(err) {
		return true, ""
	}
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	free = unix.Flock(int(f.Fd()), unix.LOCK_SH|unix.LOCK_NB) == nil
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	return free, string(b)
}

// A gate is locked until opened; "go" or "abort" decides once; remove
// deletes it; two checkpoints of one container take turns; the hold is
// bounded; LAZYFORK_DUMP_GATE=off makes none and drops a stale one.
func TestDumpGate(t *testing.T) {
	prefix := withGates(t)
	g, ok, err := closeDumpGate("c1")
	if err != nil || !ok {
		t.Fatal(ok, err)
	}
	if free, _ := gateState(t, prefix+"c1"); free {
		t.Fatal("a closed gate is not locked")
	}
	second := make(chan *dumpGate)
	go func() {
		g2, _, _ := closeDumpGate("c1")
		second <- g2
	}()
	select {
	case <-second:
		t.Fatal("a second checkpoint of the container closed the gate of the first")
	case <-time.After(100 * time.Millisecond):
	}
	if decided, err := g.open(true); !decided || err != nil || !g.wentOn() {
		t.Fatalf("open: decided %v, %v, went on %v", decided, err, g.wentOn())
	}
	if free, content := gateState(t, prefix+"c1"); !free || content != "go" {
		t.Fatalf("an opened gate: lock free %v, %q; want free, \"go\"", free, content)
	}
	if decided, _ := g.open(false); decided || !g.wentOn() {
		t.Fatal("a gate opened with go was called off after")
	}
	g.remove()
	g2 := <-second
	if g2 == nil {
		t.Fatal("the second checkpoint got no gate")
	}
	if free, content := gateState(t, prefix+"c1"); free || content != "" {
		t.Fatalf("the second gate: lock free %v, %q; want locked and empty", free, content)
	}
	g2.remove()
	if _, err := os.Stat(prefix + "c1"); !os.IsNotExist(err) {
		t.Fatalf("the gate is left after remove: %v", err)
	}
	gateLocksMu.Lock()
	kept := len(gateLocks)
	gateLocksMu.Unlock()
	if kept != 0 {
		t.Fatalf("%d gate locks kept after every checkpoint is over", kept)
	}

	// Held too long: called off; the later "go" decides nothing.
	old := gateMaxHold
	gateMaxHold = 10 * time.Millisecond
	t.Cleanup(func() { gateMaxHold = old })
	g, _, err = closeDumpGate("c2")
	if err != nil {
		t.Fatal(err)
	}
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(time.Millisecond) {
		if free, content := gateState(t, prefix+"c2"); free && content == "abort" {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("a gate held past gateMaxHold was not called off")
		}
	}
	if decided, _ := g.open(true); decided || g.wentOn() {
		t.Fatal("a called-off gate went on")
	}
	g.remove()

	// Off: no gate, and a stale one goes.
	if err := os.WriteFile(prefix+"c3", nil, 0o600); err != nil {
		t.Fatal(err)
	}
	t.Setenv(dumpGateEnv, "off")
	if g, ok, err := closeDumpGate("c3"); ok || g != nil || err != nil {
		t.Fatalf("%s=off: a gate %v %v", dumpGateEnv, ok, err)
	}
	if _, err := os.Stat(prefix + "c3"); !os.IsNotExist(err) {
		t.Fatalf("a stale gate is left: %v", err)
	}
}
