package integration

import (
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"testing"
	"time"

	runtimeapi "k8s.io/cri-api/pkg/apis/runtime/v1"

	"github.com/lazyfork/lazyfork/integration/harness"
)

// rootEntries lists every file and directory under a LazyFork root (relative
// names), the measure of what a deleted container leaves behind.
func rootEntries(t *testing.T, root string) map[string]bool {
	t.Helper()
	out := map[string]bool{}
	err := filepath.WalkDir(root, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			if os.IsNotExist(err) {
				return nil
			}
			return err
		}
		if rel, _ := filepath.Rel(root, p); rel != "." {
			out[rel] = true
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	return out
}

func added(before, after map[string]bool) []string {
	var l []string
	for p := range after {
		if !before[p] {
			l = append(l, p)
		}
	}
	sort.Strings(l)
	return l
}

// TestNothingAccumulates: pods created and removed leave nothing under the
// LazyFork root: no family directory under ROOT/mem, no ROOT/mem/.state/<id>,
// no view, no family record. (Seen before: a directory and five inodes per pod,
// 713 directories after about 700 pods with none left.) The first pod makes
// the root's fixed directories; the next ones must add nothing.
func TestNothingAccumulates(t *testing.T) {
	t.Setenv(noMemoryGCEnv, "0") // what the shims release, not what GC collects
	c := startCRI(t)
	ctx := c.ctx(t)
	// A container that stops on SIGTERM (a shell as PID 1 ignores it unless
	// it traps it).
	loop := []string{"sh", "-c", "trap 'exit 0' TERM; while :; do sleep 0.2; done"}
	cycle := func(name string, way int) {
		p := c.runPod(t, ctx, name, true, nil)
		c.run(t, ctx, p, p.containerConfig("loop", harness.BusyboxImage, loop, nil))
		short := c.run(t, ctx, p, p.containerConfig("short", harness.BusyboxImage, []string{"true"}, nil))
		waitFor(t, "the short container to exit", 60*time.Second, func() bool {
			st, err := c.rt.ContainerStatus(ctx, &runtimeapi.ContainerStatusRequest{ContainerId: short})
			return err == nil && st.Status.State == runtimeapi.ContainerState_CONTAINER_EXITED
		})
		switch way {
		case 0: // as kubelet: containers stopped and removed, then the pod
			c.stopRemove(t, ctx, p)
		case 1: // the pod stopped and removed with its containers in it
			if _, err := c.rt.StopPodSandbox(ctx, &runtimeapi.StopPodSandboxRequest{PodSandboxId: p.id}); err != nil {
				t.Fatal(err)
			}
			if _, err := c.rt.RemovePodSandbox(ctx, &runtimeapi.RemovePodSandboxRequest{PodSandboxId: p.id}); err != nil {
				t.Fatal(err)
			}
		}
	}
	cycle("warm", 0)
	before := rootEntries(t, c.Root)
	const pods = 6
	for i := 0; i < pods; i++ {
		cycle("acc", i%2)
	}
	after := rootEntries(t, c.Root)
	if l := added(before, after); len(l) > 0 {
		t.Errorf("%d pods created and removed left %d entries under the LazyFork root (before: %d, after: %d):\n  %s",
			pods, len(l), len(before), len(after), strings.Join(l, "\n  "))
	}
	t.Logf("LazyFork root: %d entries after the first pod, %d after %d more", len(before), len(after), pods)
}

// TestNothingAccumulatesForks: containers forked (a snapshot, its memory
// files, the parent's memory moved onto them) and then deleted leave nothing
// under the LazyFork root either: no family, no family record, no state.
func TestNothingAccumulatesForks(t *testing.T) {
	s := newSetupStack(t, "lfacc")
	loop := []string{"sh", "-c", "trap 'exit 0' TERM; i=0; while :; do echo $i; i=$((i+1)); sleep 0.2; done"}
	cycle := func(i int) {
		p := fmt.Sprintf("p%d", i)
		s.mustLF(append([]string{"create", "--name", p, harness.BusyboxImage, "--"}, loop...)...)
		s.mustLF("fork", p, "--name", p+"-f")
		s.mustLF("delete", "-f", p+"-f", p)
	}
	cycle(0)
	before := rootEntries(t, s.root)
	const n = 4
	for i := 1; i <= n; i++ {
		cycle(i)
	}
	after := rootEntries(t, s.root)
	if l := added(before, after); len(l) > 0 {
		t.Errorf("%d containers and their forks, deleted, left %d entries under the LazyFork root:\n  %s", n, len(l), strings.Join(l, "\n  "))
	}
	t.Logf("LazyFork root: %d entries after the first cycle, %d after %d more", len(before), len(after), n)
}
