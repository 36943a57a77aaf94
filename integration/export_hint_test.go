package integration

import (
	"os/exec"
	"strings"
	"testing"

	"github.com/lazyfork/lazyfork/internal/testutil"
)

// TestStandardRestoreHints: where a standard flow cannot take a LazyFork
// snapshot, its error says why and what to do. `ctr c restore --live` of a
// checkpoint of a running LazyFork container restores into the running
// container's cgroup, which runc refuses ("cgroup is not empty").
func TestStandardRestoreHints(t *testing.T) {
	testutil.RequiresBinary(t, "ctr")
	e, ctx, img := startLFPython(t)
	e.startCounter(t, ctx, img, "hsrc", 16)
	ref := "localhost/lazyfork-test/hsrc:ckpt"
	e.ctr(t, "containers", "checkpoint", "--task", "hsrc", ref)
	full := []string{"--address", e.Address, "--namespace", e.Namespace, "containers", "restore", "--live", "hcopy", ref}
	out, err := exec.Command("ctr", full...).CombinedOutput()
	if err == nil {
		t.Fatalf("ctr containers restore --live into the running container's cgroup succeeded:\n%s", out)
	}
	for _, want := range []string{"LazyFork snapshot", "lazyfork fork", "lazyfork export"} {
		if !strings.Contains(string(out), want) {
			t.Errorf("ctr containers restore: no %q in its error:\n%s", want, out)
		}
	}
	t.Logf("ctr containers restore --live: %s", out)
}
