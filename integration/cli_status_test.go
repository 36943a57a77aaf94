package integration

import (
	"context"
	"encoding/json"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/lazyfork/lazyfork/integration/harness"
	"github.com/lazyfork/lazyfork/internal/testutil"
	snapclient "github.com/lazyfork/lazyfork/snapshotter/client"
)

// ownSnapshotter is a lazyfork-snapshotter a test can kill and start again.
type ownSnapshotter struct {
	bin, root, address, log string
	cmd                     *exec.Cmd
	done                    chan struct{}
}

func startOwnSnapshotter(t *testing.T, bin string) *ownSnapshotter {
	t.Helper()
	dir, err := os.MkdirTemp("", "lfsn-")
	if err != nil {
		t.Fatal(err)
	}
	s := &ownSnapshotter{bin: bin, root: filepath.Join(dir, "root"), address: filepath.Join(dir, "sn.sock"), log: filepath.Join(dir, "snapshotter.log")}
	t.Cleanup(func() {
		s.stop(syscall.SIGTERM)
		if t.Failed() {
			b, _ := os.ReadFile(s.log)
			t.Logf("lazyfork-snapshotter log:\n%s", b)
		}
		if mounts, _ := harness.MountsUnder(dir); len(mounts) > 0 {
			for i := len(mounts) - 1; i >= 0; i-- {
				_ = syscall.Unmount(mounts[i], syscall.MNT_DETACH)
			}
		}
		os.RemoveAll(dir)
	})
	s.start(t)
	return s
}

func (s *ownSnapshotter) start(t *testing.T) {
	t.Helper()
	logf, err := os.OpenFile(s.log, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		t.Fatal(err)
	}
	defer logf.Close()
	_ = os.Remove(s.address)
	_ = os.Remove(snapclient.TTRPCAddress(s.address))
	// A LazyFork root of its own: never the host's, which its memory
	// collection would otherwise walk.
	s.cmd = exec.Command(filepath.Join(s.bin, "lazyfork-snapshotter"), "--root", s.root, "--address", s.address,
		"--lazyfork-root", filepath.Join(filepath.Dir(s.root), "lazyfork"))
	s.cmd.Stdout, s.cmd.Stderr = logf, logf
	if err := s.cmd.Start(); err != nil {
		t.Fatal(err)
	}
	s.done = make(chan struct{})
	go func(cmd *exec.Cmd, done chan struct{}) { cmd.Wait(); close(done) }(s.cmd, s.done)
	deadline := time.Now().Add(30 * time.Second)
	for {
		if c, err := snapclient.Dial(context.Background(), snapclient.TTRPCAddress(s.address)); err == nil {
			c.Close()
			return
		}
		select {
		case <-s.done:
			b, _ := os.ReadFile(s.log)
			t.Fatalf("lazyfork-snapshotter exited:\n%s", b)
		case <-time.After(50 * time.Millisecond):
		}
		if time.Now().After(deadline) {
			t.Fatal("lazyfork-snapshotter did not start")
		}
	}
}

// stop signals the snapshotter this test started (by its process) and waits.
func (s *ownSnapshotter) stop(sig syscall.Signal) {
	if s.cmd == nil {
		return
	}
	_ = s.cmd.Process.Signal(sig)
	select {
	case <-s.done:
	case <-time.After(30 * time.Second):
		_ = s.cmd.Process.Kill()
		<-s.done
	}
	s.cmd = nil
}

// TestCLIStatusTells: status reports a dead snapshotter dead, a fork that
// cannot reach it says to run lazyfork setup, and a user without the rights
// is told to run as root.
func TestCLIStatusTells(t *testing.T) {
	testutil.RequiresBinary(t, "setpriv")
	bin := lfBin(t)
	sn := startOwnSnapshotter(t, bin)
	t.Setenv("LAZYFORK_BIN", bin)
	e := &cliEnv{lfEnv: startLF(t, harness.Options{ProxyPlugins: []harness.ProxyPlugin{{
		Name: snapclient.SnapshotterName, Type: "snapshot", Address: sn.address, ExportsRoot: sn.root,
	}}}), logDir: t.TempDir()}
	ctx := e.ctx(t)
	if _, err := e.ImportImage(ctx, "busybox", harness.WithSnapshotter(snapclient.SnapshotterName)); err != nil {
		t.Fatal(err)
	}
	e.must(t, "create", "--name", "c", harness.BusyboxImage, "--", "sleep", "100000")
	if out := strings.TrimSpace(e.must(t, "status", "--format", "{{.Snapshotter}}")); out != "lazyfork (proxy plugin)" {
		t.Errorf("status with the snapshotter running: %q", out)
	}

	sn.stop(syscall.SIGKILL)
	out, err := e.lf(t, "status")
	if err != nil || !strings.Contains(out, "DEAD") || !strings.Contains(out, "run lazyfork setup") {
		t.Errorf("status with the snapshotter killed: %v\n%s", err, out)
	}
	var st struct{ SnapshotterAlive bool }
	if out, err := e.lf(t, "status", "--format", "json"); err != nil || json.Unmarshal([]byte(out), &st) != nil || st.SnapshotterAlive {
		t.Errorf("status --format json with the snapshotter killed: %v\n%s", err, out)
	}
	if _, err := e.lf(t, "fork", "c"); err == nil || !strings.Contains(err.Error(), "snapshotter") || !strings.Contains(err.Error(), "run lazyfork setup") {
		t.Errorf("fork with the snapshotter killed: %v", err)
	}

	// A user who may not use containerd's socket (or reach it).
	for _, args := range [][]string{
		{"--address", e.Address, "--namespace", e.Namespace, "--root", e.Root, "status"},
		{"--address", e.Address, "--namespace", e.Namespace, "list"},
	} {
		cmd := exec.Command("setpriv", append([]string{"--reuid=65534", "--regid=65534", "--clear-groups", filepath.Join(e.Bin, "lazyfork")}, args...)...)
		b, err := cmd.CombinedOutput()
		if err == nil || !strings.Contains(string(b), "permission denied: run as root") || strings.Contains(string(b), "setup") {
			t.Errorf("lazyfork %s as uid 65534: %v\n%s", strings.Join(args, " "), err, b)
		}
	}

	// Started again, the snapshotter answers, and the failed fork's
	// leftovers go with gc.
	sn.start(t)
	// (containerd reconnects to a proxy plugin after a backoff.)
	deadline := time.Now().Add(3 * time.Minute)
	for {
		out := strings.TrimSpace(e.must(t, "status", "--format", "{{.Snapshotter}}"))
		if out == "lazyfork (proxy plugin)" {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("status with the snapshotter started again: %q", out)
		}
		time.Sleep(200 * time.Millisecond)
	}
	e.must(t, "gc")
	e.must(t, "delete", "-f", "c")
}
