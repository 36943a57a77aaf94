package criuproxy

import (
	"bytes"
	"encoding/hex"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/checkpoint-restore/go-criu/v7/rpc"
	"golang.org/x/sys/unix"
)

// gateRun is a `runc COMMAND ... ID` stand-in that runs the proxy as its
// child (`criu swrk 3`, the socket on fd 3), as runc does, and the state of
// that run.
type gateRun struct {
	cmd     *exec.Cmd
	cln     *os.File
	started string // the fake real CRIU creates it when it starts
}

// startGateRun starts the stand-in with args and sends req, the proxy
// run as `criu swrk 3` (runc's own requests).
func startGateRun(t *testing.T, criu, gatePrefix string, req []byte, args ...string) *gateRun {
	t.Helper()
	return startGateRunFD(t, criu, 3, gatePrefix, req, args...)
}

// startGateRunFD is startGateRun with the socket at fd.
func startGateRunFD(t *testing.T, criu string, fd int, gatePrefix string, req []byte, args ...string) *gateRun {
	t.Helper()
	dir := t.TempDir()
	started := filepath.Join(dir, "started")
	real := filepath.Join(dir, "criu")
	if err := os.WriteFile(real, []byte("#!/bin/sh\n: > "+started+"\n"+fakeScript[len("#!/bin/sh\n"):]), 0o755); err != nil {
		t.Fatal(err)
	}
	runc := filepath.Join(dir, "runc")
	if err := os.WriteFile(runc, []byte("#!/bin/sh\n\"$PROXY\" swrk "+strconv.Itoa(fd)+"\nexit $?\n"), 0o755); err != nil {
		t.Fatal(err)
	}
	fds, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_SEQPACKET|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	cln, srv := os.NewFile(uintptr(fds[0]), "cln"), os.NewFile(uintptr(fds[1]), "srv")
	t.Cleanup(func() { cln.Close() })
	cmd := exec.Command(runc, args...)
	cmd.Env = append(os.Environ(), answerEnv(t, real, []byte("cached"))...)
	cmd.Env = append(cmd.Env, "PROXY="+criu, EnvGate+"="+gatePrefix)
	for len(cmd.ExtraFiles) < fd-3 {
		null, err := os.Open(os.DevNull)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { null.Close() })
		cmd.ExtraFiles = append(cmd.ExtraFiles, null)
	}
	cmd.ExtraFiles = append(cmd.ExtraFiles, srv)
	cmd.Stderr = &bytes.Buffer{}
	if _, err := cln.Write(req); err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	srv.Close()
	t.Cleanup(func() { cmd.Process.Kill(); cmd.Wait() })
	return &gateRun{cmd: cmd, cln: cln, started: started}
}

// answer is what came back on the socket before it closed, and the run's exit.
func (g *gateRun) answer() (string, error) {
	resp := make([]byte, 64<<10)
	n, err := g.cln.Read(resp)
	if err != nil && err != io.EOF {
		return "", err
	}
	return string(resp[:n]), g.cmd.Wait()
}

func (g *gateRun) criuStarted() bool {
	_, err := os.Stat(g.started)
	return err == nil
}

// lockedGate makes the gate of id under prefix, locked as the shim holds it.
func lockedGate(t *testing.T, prefix, id string) *os.File {
	t.Helper()
	f, err := os.OpenFile(prefix+id, os.O_RDWR|os.O_CREATE|os.O_TRUNC, 0o600)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { f.Close() })
	if err := unix.Flock(int(f.Fd()), unix.LOCK_EX); err != nil {
		t.Fatal(err)
	}
	return f
}

// waitBlocked waits until a process waits for the lock of f (a "->" line
// for its inode in /proc/locks).
func waitBlocked(t *testing.T, f *os.File) {
	t.Helper()
	var st unix.Stat_t
	if err := unix.Fstat(int(f.Fd()), &st); err != nil {
		t.Fatal(err)
	}
	ino := ":" + strconv.FormatUint(st.Ino, 10) + " "
	for deadline := time.Now().Add(10 * time.Second); time.Now().Before(deadline); time.Sleep(time.Millisecond) {
		b, err := os.ReadFile("/proc/locks")
		if err != nil {
			t.Fatal(err)
		}
		for _, l := range strings.Split(string(b), "\n") {
			if strings.Contains(l, "->") && strings.Contains(l, ino) {
				return
			}
		}
	}
	t.Fatal("nothing waited at the gate")
}

// openGate writes state into the gate and unlocks it, as the shim does.
func openGate(t *testing.T, f *os.File, state string) {
	t.Helper()
	if _, err := f.WriteAt([]byte(state), 0); err != nil {
		t.Fatal(err)
	}
	if err := unix.Flock(int(f.Fd()), unix.LOCK_UN); err != nil {
		t.Fatal(err)
	}
}

// TestProxyDumpGate: a `runc checkpoint` of a container whose gate the shim
// holds locked gets no CRIU until the gate opens: with "go" the real CRIU
// runs the dump; with anything else the run ends there, CRIU never started.
// Without a gate, or for another runc command, CRIU starts at once.
func TestProxyDumpGate(t *testing.T) {
	criu, _, _ := proxy(t)
	prefix := filepath.Join(t.TempDir(), "1234.")
	dump := mustMarshal(t, &rpc.CriuReq{Type: rpc.CriuReqType_DUMP.Enum()})
	want := "real CRIU " + hex.EncodeToString(dump)
	hold := 200 * time.Millisecond // how long a held dump is watched not to start

	t.Run("go", func(t *testing.T) {
		gate := lockedGate(t, prefix, "ctr-go")
		run := startGateRun(t, criu, prefix, dump, "--root", "/r", "checkpoint", "--image-path", "/i", "ctr-go")
		waitBlocked(t, gate)
		time.Sleep(hold)
		if run.criuStarted() {
			t.Fatal("CRIU started while the gate was closed")
		}
		openGate(t, gate, "go")
		if got, err := run.answer(); err != nil || got != want {
			t.Fatalf("after go: %q %v, want the real CRIU's answer", got, err)
		}
	})
	t.Run("abort", func(t *testing.T) {
		gate := lockedGate(t, prefix, "ctr-abort")
		run := startGateRun(t, criu, prefix, dump, "checkpoint", "ctr-abort")
		waitBlocked(t, gate)
		openGate(t, gate, "abort")
		if got, err := run.answer(); err == nil || got != "" || run.criuStarted() {
			t.Fatalf("after abort: answer %q, exit %v, CRIU started %v; want no answer, a failure and no CRIU", got, err, run.criuStarted())
		}
	})
	t.Run("shim gone", func(t *testing.T) {
		gate := lockedGate(t, prefix, "ctr-gone")
		run := startGateRun(t, criu, prefix, dump, "checkpoint", "ctr-gone")
		waitBlocked(t, gate)
		gate.Close() // the lock goes with the shim, "go" never written
		if got, err := run.answer(); err == nil || got != "" || run.criuStarted() {
			t.Fatalf("gate dropped: answer %q, exit %v, CRIU started %v; want no dump", got, err, run.criuStarted())
		}
	})
	t.Run("another socket", func(t *testing.T) {
		// A dump on a socket other than runc's fd 3 (another runtime's
		// CRIU client) waits at the gate too.
		gate := lockedGate(t, prefix, "ctr-fd")
		run := startGateRunFD(t, criu, 5, prefix, dump, "checkpoint", "ctr-fd")
		waitBlocked(t, gate)
		if run.criuStarted() {
			t.Fatal("CRIU started while the gate was closed")
		}
		openGate(t, gate, "go")
		if got, err := run.answer(); err != nil || got != want {
			t.Fatalf("after go: %q %v, want the real CRIU's answer", got, err)
		}
	})
	t.Run("version check", func(t *testing.T) {
		// runc's version check (go-criu's) before a held-back dump is
		// answered at once, the gate closed.
		lockedGate(t, prefix, "ctr-version")
		version := mustMarshal(t, &rpc.CriuReq{Type: rpc.CriuReqType_VERSION.Enum()})
		run := startGateRunFD(t, criu, 4, prefix, version, "checkpoint", "ctr-version")
		if got, err := run.answer(); err != nil || got != "cached" {
			t.Fatalf("a version check with the gate closed: %q %v, want the cached answer", got, err)
		}
	})
	t.Run("not a file", func(t *testing.T) {
		if err := unix.Mkfifo(prefix+"ctr-fifo", 0o600); err != nil {
			t.Fatal(err)
		}
		run := startGateRun(t, criu, prefix, dump, "checkpoint", "ctr-fifo")
		if got, err := run.answer(); err == nil || got != "" || run.criuStarted() {
			t.Fatalf("a fifo for a gate: answer %q, exit %v, CRIU started %v; want no dump", got, err, run.criuStarted())
		}
	})
	t.Run("no gate", func(t *testing.T) {
		run := startGateRun(t, criu, prefix, dump, "checkpoint", "ctr-none")
		if got, err := run.answer(); err != nil || got != want {
			t.Fatalf("no gate: %q %v, want the real CRIU's answer", got, err)
		}
	})
	t.Run("restore", func(t *testing.T) {
		lockedGate(t, prefix, "ctr-restore") // held for good: a restore must not wait
		run := startGateRun(t, criu, prefix, dump, "restore", "--image-path", "/i", "ctr-restore")
		if got, err := run.answer(); err != nil || got != want {
			t.Fatalf("restore with a closed gate of the same id: %q %v, want the real CRIU's answer", got, err)
		}
	})
}
