package integration

import (
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"syscall"
	"testing"
	"time"

	"github.com/lazyfork/lazyfork/integration/harness"
	"github.com/lazyfork/lazyfork/node"
)

// nodeAPI is a lazyfork-snapshotter serving the node API of a private stack's
// LazyFork root, as lazyfork setup runs it beside containerd: the shim asks
// it for a pod's fork-of of a running container or a kept snapshot. Its
// socket lies outside the root (which the first shim mounts a tmpfs over);
// the stack's shims find it through LAZYFORK_API (Env).
type nodeAPI struct {
	dir, socket string
}

func newNodeAPI(t *testing.T) *nodeAPI {
	t.Helper()
	dir, err := os.MkdirTemp("", "lfna-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	return &nodeAPI{dir: dir, socket: filepath.Join(dir, "sn.sock.ttrpc")}
}

// Env is what the stack's containerd (and so its shims) needs.
func (n *nodeAPI) Env() string { return "LAZYFORK_API=" + n.socket }

// start runs the snapshotter on LazyFork root root until the test ends;
// call it after startLF, so that it stops before containerd's teardown. Its
// memory collection runs every memoryGCInterval, far more often than the
// default, so that the tests' forks, snapshots and pods run beside it.
func (n *nodeAPI) start(t *testing.T, bin, root string) {
	t.Helper()
	runSnapshotter(t, bin, filepath.Join(n.dir, "snapshotter.log"), n.dir, func() error {
		r := node.NewRemote(n.socket)
		defer r.Close()
		_, err := r.FreeSpace(context.Background())
		return err
	}, "--root", filepath.Join(n.dir, "sn"), "--address", filepath.Join(n.dir, "sn.sock"), "--lazyfork-root", root,
		"--memory-gc-interval", testMemoryGCInterval())
}

// memoryGCInterval is the memory collection's interval in the snapshotters
// the tests run on a stack's LazyFork root.
const memoryGCInterval = "200ms"

// noMemoryGCEnv, set to "0", turns the collection off in the snapshotters
// of the test that sets it: a test of what the shims release themselves
// must not have the collection clean up after them.
const noMemoryGCEnv = "LAZYFORK_TEST_MEMORY_GC_INTERVAL"

func testMemoryGCInterval() string {
	if v := os.Getenv(noMemoryGCEnv); v != "" {
		return v
	}
	return memoryGCInterval
}

// runSnapshotter runs bin's lazyfork-snapshotter with args until the test
// ends (SIGTERM, then SIGKILL after 30 s; its log, logPath, shown if the test
// failed; mounts left under mountsUnder, when set, detached), and waits up to
// 30 s for ready to succeed.
func runSnapshotter(t *testing.T, bin, logPath, mountsUnder string, ready func() error, args ...string) {
	t.Helper()
	logf, err := os.Create(logPath)
	if err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(filepath.Join(bin, "lazyfork-snapshotter"), args...)
	cmd.Stdout, cmd.Stderr = logf, logf
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	logf.Close()
	done := make(chan struct{})
	go func() { cmd.Wait(); close(done) }()
	t.Cleanup(func() {
		_ = cmd.Process.Signal(syscall.SIGTERM)
		select {
		case <-done:
		case <-time.After(30 * time.Second):
			_ = cmd.Process.Kill()
			<-done
		}
		if t.Failed() {
			b, _ := os.ReadFile(logPath)
			t.Logf("lazyfork-snapshotter log (%s):\n%s", logPath, b)
		}
		if mountsUnder == "" {
			return
		}
		if mounts, _ := harness.MountsUnder(mountsUnder); len(mounts) > 0 {
			for i := len(mounts) - 1; i >= 0; i-- {
				_ = syscall.Unmount(mounts[i], syscall.MNT_DETACH)
			}
		}
	})
	deadline := time.Now().Add(30 * time.Second)
	for {
		err := ready()
		if err == nil {
			return
		}
		select {
		case <-done:
			b, _ := os.ReadFile(logPath)
			t.Fatalf("lazyfork-snapshotter exited:\n%s", b)
		case <-time.After(50 * time.Millisecond):
		}
		if time.Now().After(deadline) {
			t.Fatalf("lazyfork-snapshotter does not answer: %v", err)
		}
	}
}
