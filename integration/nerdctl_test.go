package integration

import (
	"fmt"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/lazyfork/lazyfork/integration/harness"
	"github.com/lazyfork/lazyfork/internal/testutil"
)

// nerdctl runs nerdctl against the private containerd with a private data root.
func (e *lfEnv) nerdctl(t *testing.T, args ...string) (string, error) {
	t.Helper()
	full := append([]string{"--address", e.Address, "--namespace", e.Namespace,
		"--data-root", filepath.Join(e.Dir, "nerdctl"), "--cgroup-manager", "cgroupfs"}, args...)
	cmd := exec.Command("nerdctl", full...)
	cmd.Env = append(cmd.Environ(), "PATH="+e.Bin+":/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin")
	out, err := cmd.CombinedOutput()
	if err != nil {
		return string(out), err
	}
	return stripCgroupWarning(string(out)), nil
}

func (e *lfEnv) mustNerdctl(t *testing.T, args ...string) string {
	t.Helper()
	out, err := e.nerdctl(t, args...)
	if err != nil {
		t.Fatalf("nerdctl %s: %v\n%s", strings.Join(args, " "), err, out)
	}
	return out
}

// TestNerdctlFlows: `nerdctl run --runtime io.containerd.lazyfork.v1`, then
// `nerdctl checkpoint create --leave-running` and `nerdctl start --checkpoint`
// into a new container: the new container continues the count.
func TestNerdctlFlows(t *testing.T) {
	testutil.RequiresBinary(t, "nerdctl")
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

	e.mustNerdctl(t, "checkpoint", "create", "--leave-running", id, "cp1")
	if st := e.taskStatus(t, e.nerdctlID(t, id)); st != "RUNNING" {
		t.Errorf("after nerdctl checkpoint create --leave-running the parent is %q", st)
	}
	// A new container from the same image, started from the checkpoint.
	nid := "ndf-" + lfRandom(4)
	cargs := append([]string{"create", "--name", nid, "--runtime", lfRuntime, "--net", "none",
		"--cgroup-parent", e.CgroupParent, harness.PythonImage}, pyHold(32, "")...)
	e.mustNerdctl(t, cargs...)
	// Garbage collected before `nerdctl start --checkpoint NAME`: nerdctl (2.2.1, and
	// its main branch) uploads the checkpoint directory's tar to the content store with
	// a gc.root label, but when a blob of that digest exists already it takes it as it
	// is, without the label. And it does exist: `nerdctl checkpoint create` got the very
	// same tar from containerd (containerd tars the image, nerdctl extracts it with
	// every name, mode and time, and tars it again byte for byte) under a checkpoint
	// image it deleted at the end, leaving the blob to containerd's next, asynchronous
	// collection. Were that to run between nerdctl's upload and its task create, the
	// task create failed with "content digest not found" (seen once). Collected before,
	// the upload writes a fresh blob with its label.
	if err := e.CollectGarbage(ctx); err != nil {
		t.Fatal(err)
	}
	e.mustNerdctl(t, "start", "--checkpoint", "cp1", nid)
	first := e.waitNerdctlLog(t, nid, func(l string) bool { return strings.HasPrefix(l, "tick ") })
	k, err := strconv.Atoi(strings.TrimPrefix(first, "tick "))
	if err != nil || k < 4 {
		t.Fatalf("restored container's first line %q does not continue the count", first)
	}
	plog := e.mustNerdctl(t, "logs", id)
	if !strings.Contains(plog, fmt.Sprintf("tick %d\n", k-1)) {
		t.Errorf("restored container starts at %q, its parent never printed tick %d", first, k-1)
	}
	ps := e.mustNerdctl(t, "ps")
	if !strings.Contains(ps, id) || !strings.Contains(ps, nid) {
		t.Errorf("nerdctl ps does not list both:\n%s", ps)
	}
	// The parent keeps running; both are removed the nerdctl way.
	e.mustNerdctl(t, "rm", "-f", nid, id)
}

// nerdctlID is the full id of a nerdctl container name.
func (e *lfEnv) nerdctlID(t *testing.T, name string) string {
	t.Helper()
	return strings.TrimSpace(e.mustNerdctl(t, "inspect", "--format", "{{.ID}}", name))
}

// waitNerdctlLog polls `nerdctl logs` until a line matches.
func (e *lfEnv) waitNerdctlLog(t *testing.T, name string, match func(string) bool) string {
	t.Helper()
	deadline := time.Now().Add(2 * time.Minute)
	var out string
	for time.Now().Before(deadline) {
		out, _ = e.nerdctl(t, "logs", name)
		for _, l := range strings.Split(out, "\n") {
			if match(l) {
				return l
			}
		}
		time.Sleep(100 * time.Millisecond)
	}
	t.Fatalf("nerdctl logs %s: no matching line; got:\n%s", name, out)
	return ""
}
