package integration

import (
	"bufio"
	"context"
	"fmt"
	"os"
	"os/exec"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/lazyfork/lazyfork/integration/harness"
	"github.com/lazyfork/lazyfork/internal/testutil"
)

// TestReapOrphans kills (SIGKILL) a process that runs a harness with a running
// container, so that no teardown runs, and checks that the next harness start
// (ReapOrphans) removes all it left: daemon, shim, container process, cgroups,
// mounts, directory.
func TestReapOrphans(t *testing.T) {
	if os.Getenv("LFH_REAP_CHILD") == "1" {
		reapChild()
		return
	}
	testutil.RequiresBinary(t, "containerd")
	testutil.RequiresBinary(t, "runc")
	// Build the image first so the child only imports it.
	if _, err := harness.EnsureImage(t.Context(), "busybox"); err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(os.Args[0], "-test.run=^TestReapOrphans$", "-test.v")
	cmd.Env = append(os.Environ(), "LFH_REAP_CHILD=1")
	out, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	cmd.Stderr = os.Stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	var dir, cgroup, address string
	var pid int
	sc := bufio.NewScanner(out)
	for sc.Scan() {
		if _, err := fmt.Sscanf(sc.Text(), "CHILD %s %s %s %d", &dir, &cgroup, &address, &pid); err == nil {
			break
		}
	}
	_ = cmd.Process.Kill()
	_ = cmd.Wait()
	if dir == "" {
		t.Fatal("child did not start its harness")
	}
	t.Cleanup(func() { _ = harness.Reap(context.Background(), dir) })
	if err := syscall.Kill(pid, 0); err != nil {
		t.Fatalf("the child's container %d is not running before the reap: %v", pid, err)
	}

	// The next harness start reaps the orphan.
	h := harness.StartT(t, harness.Options{})
	_ = h
	deadline := time.Now().Add(30 * time.Second)
	for {
		if _, err := os.Stat(dir); os.IsNotExist(err) {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("orphan harness %s not reaped", dir)
		}
		time.Sleep(100 * time.Millisecond)
	}
	if b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid)); err == nil && !strings.Contains(string(b), ") Z") {
		t.Errorf("container process %d survived", pid)
	}
	if pids := harness.ShimPIDs(address); len(pids) > 0 {
		t.Errorf("shims left: %v", pids)
	}
	if d := harness.CgroupDirs(cgroup); len(d) > 0 {
		t.Errorf("cgroups left: %v", d)
	}
	if m, _ := harness.MountsUnder(dir); len(m) > 0 {
		t.Errorf("mounts left: %v", m)
	}
}

// reapChild starts a harness with a sleeping container, reports it, and waits to
// be killed.
func reapChild() {
	ctx := context.Background()
	h, err := harness.Start(ctx, harness.Options{})
	if err != nil {
		fmt.Println("CHILD-ERROR", err)
		return
	}
	img, err := h.ImportImage(ctx, "busybox")
	if err != nil {
		fmt.Println("CHILD-ERROR", err)
		return
	}
	ctr, err := h.NewContainer(ctx, "orphan", harness.ContainerConfig{Image: img, Args: []string{"/bin/sleep", "1000"}})
	if err != nil {
		fmt.Println("CHILD-ERROR", err)
		return
	}
	task, err := h.StartTask(ctx, ctr)
	if err != nil {
		fmt.Println("CHILD-ERROR", err)
		return
	}
	fmt.Printf("CHILD %s %s %s %d\n", h.Dir, h.CgroupParent, h.Address, task.Pid())
	time.Sleep(10 * time.Minute)
}
