package integration

import (
	"context"
	"fmt"
	"os"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/lazyfork/lazyfork/integration/harness"
	"github.com/lazyfork/lazyfork/internal/testutil"
)

// TestHarnessBusybox runs `echo` in a busybox container on a private containerd,
// leaves a second container running, and checks that the teardown leaves nothing:
// no directory, shim, container process, cgroup or mount.
func TestHarnessBusybox(t *testing.T) {
	testutil.RequiresBinary(t, "containerd")
	testutil.RequiresBinary(t, "runc")
	h := harness.StartT(t, harness.Options{})
	ctx, cancel := context.WithTimeout(h.Context(t.Context()), 3*time.Minute)
	defer cancel()

	img, err := h.ImportImage(ctx, "busybox")
	if err != nil {
		t.Fatal(err)
	}
	word := "hello-" + h.Namespace
	echo, err := h.NewContainer(ctx, "echo", harness.ContainerConfig{Image: img, Args: []string{"/bin/echo", word}})
	if err != nil {
		t.Fatal(err)
	}
	task, err := h.NewTask(ctx, echo)
	if err != nil {
		t.Fatal(err)
	}
	exitCh, err := task.Wait(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if err := task.Start(ctx); err != nil {
		t.Fatal(err)
	}
	st := <-exitCh
	if code, _, err := st.Result(); err != nil || code != 0 {
		t.Fatalf("echo exited %d (%v)", code, err)
	}
	out, err := os.ReadFile(h.TaskLogPath("echo"))
	if err != nil || strings.TrimSpace(string(out)) != word {
		t.Fatalf("echo log = %q (%v), want %q", out, err, word)
	}
	if _, err := task.Delete(ctx); err != nil {
		t.Fatal(err)
	}

	// A running container that the teardown has to kill.
	sleeper, err := h.NewContainer(ctx, "sleeper", harness.ContainerConfig{Image: img, Args: []string{"/bin/sleep", "1000"}})
	if err != nil {
		t.Fatal(err)
	}
	stask, err := h.StartTask(ctx, sleeper)
	if err != nil {
		t.Fatal(err)
	}
	pid := int(stask.Pid())
	if len(harness.CgroupDirs(h.CgroupPath("sleeper"))) == 0 {
		t.Fatalf("no cgroup %s for the running container", h.CgroupPath("sleeper"))
	}
	if len(harness.ShimPIDs(h.Address)) == 0 {
		t.Fatal("no shim found for the running container")
	}

	if err := h.Stop(); err != nil {
		t.Fatalf("teardown: %v", err)
	}
	if err := syscall.Kill(pid, 0); err == nil {
		if b, _ := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid)); !strings.Contains(string(b), ") Z") {
			t.Errorf("container process %d survived the teardown", pid)
		}
	}
	if _, err := os.Stat(h.Dir); !os.IsNotExist(err) {
		t.Errorf("harness dir %s left (%v)", h.Dir, err)
	}
	if pids := harness.ShimPIDs(h.Address); len(pids) > 0 {
		t.Errorf("shims left: %v", pids)
	}
	if dirs := harness.CgroupDirs(h.CgroupParent); len(dirs) > 0 {
		t.Errorf("cgroups left: %v", dirs)
	}
	if m, _ := harness.MountsUnder(h.Dir); len(m) > 0 {
		t.Errorf("mounts left: %v", m)
	}
}
