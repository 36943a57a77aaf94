package integration

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"

	"github.com/lazyfork/lazyfork/integration/harness"
	"github.com/lazyfork/lazyfork/internal/testutil"
)

// TestNerdctlStartExport: `nerdctl start --checkpoint` into a runc container
// takes a LazyFork container's export. A nerdctl checkpoint of a LazyFork
// container is a LazyFork snapshot (its memory in memory files) that runc
// cannot restore; the export's checkpoint/ directory is a standard CRIU
// image, so the documented sequence works: `lazyfork export NAME -o F`,
// `tar -xf F -C DIR/NAME --strip-components=1 checkpoint`, then
// `nerdctl start --checkpoint NAME --checkpoint-dir DIR` of a runc container
// of the same image and command. The runc container continues the count
// from ordinary memory.
func TestNerdctlStartExport(t *testing.T) {
	testutil.RequiresBinary(t, "nerdctl")
	testutil.RequiresBinary(t, "tar")
	e := startLF(t, harness.Options{})
	ctx := e.ctx(t)
	if _, err := e.ImportImage(ctx, "python"); err != nil {
		t.Fatal(err)
	}
	id := "nd-" + lfRandom(4)
	args := append([]string{"run", "-d", "--name", id, "--runtime", lfRuntime, "--net", "none",
		"--cgroup-parent", e.CgroupParent, harness.PythonImage}, pyHold(32, "")...)
	e.mustNerdctl(t, args...)
	e.waitNerdctlLog(t, id, func(l string) bool { return l == "tick 3" })

	archive := filepath.Join(t.TempDir(), "exp.tar")
	if _, err := e.lfCLI(t, "export", id, "-o", archive); err != nil {
		t.Fatalf("lazyfork export of a nerdctl container: %v", err)
	}
	dir := t.TempDir()
	if err := os.Mkdir(filepath.Join(dir, "exp"), 0o700); err != nil {
		t.Fatal(err)
	}
	if out, err := exec.Command("tar", "-xf", archive, "-C", filepath.Join(dir, "exp"), "--strip-components=1", "checkpoint").CombinedOutput(); err != nil {
		t.Fatalf("tar: %v\n%s", err, out)
	}

	rid := "ndr-" + lfRandom(4)
	cargs := append([]string{"create", "--name", rid, "--runtime", "io.containerd.runc.v2", "--net", "none",
		"--cgroup-parent", e.CgroupParent, harness.PythonImage}, pyHold(32, "")...)
	e.mustNerdctl(t, cargs...)
	e.mustNerdctl(t, "start", "--checkpoint", "exp", "--checkpoint-dir", dir, rid)
	first := e.waitNerdctlLog(t, rid, func(l string) bool { return strings.HasPrefix(l, "tick ") })
	k, err := strconv.Atoi(strings.TrimPrefix(first, "tick "))
	if err != nil || k < 4 {
		t.Fatalf("runc container's first line %q does not continue the count", first)
	}
	if plog := e.mustNerdctl(t, "logs", id); !strings.Contains(plog, fmt.Sprintf("tick %d\n", k-1)) {
		t.Errorf("runc container starts at %q, its parent never printed tick %d", first, k-1)
	}
	e.waitNerdctlLog(t, rid, func(l string) bool { return l == fmt.Sprintf("tick %d", k+2) })
	pid := strings.TrimSpace(e.mustNerdctl(t, "inspect", "--format", "{{.State.Pid}}", rid))
	n, err := strconv.Atoi(pid)
	if err != nil {
		t.Fatalf("pid of %s: %q", rid, pid)
	}
	if mapsMemFiles(t, uint32(n)) {
		t.Errorf("the runc restore maps LazyFork memory files")
	}
	e.mustNerdctl(t, "rm", "-f", rid, id)
}
