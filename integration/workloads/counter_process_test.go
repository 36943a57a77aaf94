package workloads

import (
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/containerd/containerd/v2/client"

	"github.com/lazyfork/lazyfork/integration/harness"
	"github.com/lazyfork/lazyfork/internal/testutil"
)

// proc adapts an os.Process to Signaler.
type proc struct{ p *os.Process }

func (p proc) Kill(_ context.Context, s syscall.Signal, _ ...client.KillOpts) error {
	return p.p.Signal(s)
}

// TestCounterProtocol runs counter.py as a plain process (no root needed) and
// walks its whole protocol: ready, ticks, verify, write, verify, SIGTERM.
func TestCounterProtocol(t *testing.T) {
	py, err := exec.LookPath("python3")
	if err != nil {
		if testutil.InCI() {
			t.Fatal("CI=true but python3 is not on PATH")
		}
		t.Skip("python3 not on PATH")
	}
	log := filepath.Join(t.TempDir(), "counter.log")
	f, err := os.Create(log)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	cmd := exec.Command(py, filepath.Join(SourceDir(), "counter.py"), "8", "--interval", "0.02")
	cmd.Stdout, cmd.Stderr = f, f
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- cmd.Wait() }()
	t.Cleanup(func() {
		_ = cmd.Process.Kill()
		<-done
	})
	ctx, cancel := context.WithTimeout(t.Context(), 2*time.Minute)
	defer cancel()
	p := proc{cmd.Process}

	ready, err := WaitReady(ctx, log)
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(ready, "pages=2048") {
		t.Errorf("ready line %q, want pages=2048 for 8 MiB", ready)
	}
	if _, err := WaitTickAbove(ctx, log, 2); err != nil {
		t.Fatal(err)
	}
	if line, err := Verify(ctx, p, log); err != nil || line != "verify ok pages=2048 writes=0" {
		t.Fatalf("verify: %q %v", line, err)
	}
	if line, err := Write(ctx, p, log); err != nil || !strings.HasSuffix(line, "writes=1") {
		t.Fatalf("write: %q %v", line, err)
	}
	if line, err := Verify(ctx, p, log); err != nil || line != "verify ok pages=2048 writes=1" {
		t.Fatalf("verify after write: %q %v", line, err)
	}
	last, err := LastTick(log)
	if err != nil || last < 3 {
		t.Fatalf("last tick %d (%v)", last, err)
	}
	if err := cmd.Process.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	select {
	case err := <-done:
		done <- err // for the cleanup
		if err != nil {
			t.Fatalf("exit after SIGTERM: %v", err)
		}
	case <-ctx.Done():
		t.Fatal("no exit after SIGTERM")
	}
	lines, _ := harness.ReadLines(log)
	if got := lines[len(lines)-1]; !strings.HasPrefix(got, "exit ticks=") {
		t.Errorf("last line %q, want exit ticks=N", got)
	}
}
