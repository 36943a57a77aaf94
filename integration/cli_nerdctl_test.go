package integration

import (
	"encoding/json"
	"os"
	"reflect"
	"strconv"
	"strings"
	"testing"

	"github.com/lazyfork/lazyfork/integration/harness"
	"github.com/lazyfork/lazyfork/internal/testutil"
)

// TestCLINerdctlFork: lazyfork resolves nerdctl's names, and a fork of a
// nerdctl container is a whole nerdctl container: nerdctl ps lists it by its
// own name, nerdctl logs, exec and rm work on it, and its removal leaves the
// parent's name, state and log alone.
func TestCLINerdctlFork(t *testing.T) {
	testutil.RequiresBinary(t, "nerdctl")
	e := startCLIEnv(t)
	ctx := e.ctx(t)
	if _, err := e.ImportImage(ctx, "python"); err != nil {
		t.Fatal(err)
	}
	e.mustNerdctl(t, append([]string{"run", "-d", "--name", "nd", "--runtime", lfRuntime, "--net", "none",
		"--cgroup-parent", e.CgroupParent, harness.PythonImage}, pyHold(16, "")...)...)
	e.waitNerdctlLog(t, "nd", func(l string) bool { return l == "tick 3" })
	parentID := e.nerdctlID(t, "nd")

	// By nerdctl's name; named, and not.
	if out := strings.TrimSpace(e.must(t, "fork", "nd", "--name", "ndf")); out != "ndf" {
		t.Fatalf("fork nd --name ndf printed %q", out)
	}
	// Two: they join the shim ndf's call started, which has room
	// (client/shimjoin.go), without a shim start.
	anons := strings.Fields(e.must(t, "fork", "nd", "--count", "2"))
	if len(anons) != 2 {
		t.Fatalf("fork nd --count 2 printed %q", anons)
	}
	for _, anon := range anons {
		if sb := e.bundleFile(t, anon, "sandbox"); sb != "ndf" {
			t.Errorf("fork %s names sandbox %q, want ndf: it did not join the family's shim", anon, sb)
		}
	}
	var anonNames []string
	for _, anon := range anons {
		anonNames = append(anonNames, "nd-"+anon[strings.LastIndex(anon, "-")+1:])
	}

	ps := e.mustNerdctl(t, "ps", "--format", "{{.Names}} {{.Status}}")
	for _, n := range append([]string{"nd", "ndf"}, anonNames...) {
		if !strings.Contains(ps, n+" Up") {
			t.Errorf("nerdctl ps does not list %s running:\n%s", n, ps)
		}
	}
	// nerdctl logs: the fork's own output, continuing the count.
	first := e.waitNerdctlLog(t, "ndf", func(l string) bool { return strings.HasPrefix(l, "tick ") })
	if k, _ := strconv.Atoi(strings.TrimPrefix(first, "tick ")); k <= 3 {
		t.Errorf("nerdctl logs ndf begins at %q: not after the parent's tick 3", first)
	}
	if out, _ := e.nerdctl(t, "logs", "ndf"); strings.Contains(out, "ready") {
		t.Errorf("nerdctl logs ndf shows the parent's output:\n%.300s", out)
	}
	if out := e.waitLogsLine(t, "ndf", func(l string) bool { return l == first }); strings.Contains(out, "ready") {
		t.Errorf("lazyfork logs ndf shows the parent's output")
	}
	for _, n := range []string{"ndf", anonNames[1]} {
		if out := strings.TrimSpace(e.mustNerdctl(t, "exec", n, "echo", "hi")); out != "hi" {
			t.Errorf("nerdctl exec %s: %q", n, out)
		}
	}

	// nerdctl rm of the forks: gone, names free; the parent untouched.
	pLabels := e.ctrLabels(t, parentID)
	e.mustNerdctl(t, "rm", "-f", "ndf")
	e.mustNerdctl(t, append([]string{"rm", "-f"}, anonNames...)...)
	ls := e.ctr(t, "containers", "ls", "-q")
	if strings.Contains(ls, "ndf") || strings.Contains(ls, anons[0]) || strings.Contains(ls, anons[1]) {
		t.Errorf("after nerdctl rm of the forks, ctr lists:\n%s", ls)
	}
	if ps := e.mustNerdctl(t, "ps", "-a", "--format", "{{.Names}}"); strings.TrimSpace(ps) != "nd" {
		t.Errorf("nerdctl ps -a after removing the forks:\n%s", ps)
	}
	if l := e.ctrLabels(t, parentID); !reflect.DeepEqual(l, pLabels) {
		t.Errorf("the parent's labels changed:\n%v\nto\n%v", pLabels, l)
	}
	if _, err := os.Stat(pLabels["nerdctl/state-dir"]); err != nil {
		t.Errorf("the parent's nerdctl state after its forks' removal: %v", err)
	}
	e.waitNerdctlLog(t, "nd", func(l string) bool { return l == "tick 3" })
	if st := e.taskStatus(t, parentID); st != "RUNNING" {
		t.Errorf("parent after its forks' removal: %q", st)
	}
	e.mustNerdctl(t, "create", "--name", "ndf", "--net", "none", harness.PythonImage, "true")
	e.mustNerdctl(t, "rm", "ndf")

	// lazyfork delete of a nerdctl fork removes its nerdctl state too.
	fork2 := strings.TrimSpace(e.must(t, "fork", "nd", "--name", "ndg"))
	state := e.ctrLabels(t, fork2)["nerdctl/state-dir"]
	if state == "" || state == pLabels["nerdctl/state-dir"] {
		t.Fatalf("fork ndg's nerdctl state directory: %q", state)
	}
	e.must(t, "delete", "-f", "ndg")
	if _, err := os.Stat(state); !os.IsNotExist(err) {
		t.Errorf("lazyfork delete left the fork's nerdctl state %s: %v", state, err)
	}
	if ps := e.mustNerdctl(t, "ps", "-a", "--format", "{{.Names}}"); strings.TrimSpace(ps) != "nd" {
		t.Errorf("nerdctl ps -a after lazyfork delete:\n%s", ps)
	}
	if out, err := e.nerdctl(t, "create", "--name", "ndg", "--net", "none", harness.PythonImage, "true"); err != nil {
		t.Errorf("the name of a fork lazyfork deleted is not free: %v\n%s", err, out)
	} else {
		e.mustNerdctl(t, "rm", "ndg")
	}
	e.mustNerdctl(t, "rm", "-f", "nd")
}

// ctrLabels are a container's labels, as ctr containers info shows them.
func (e *cliEnv) ctrLabels(t *testing.T, id string) map[string]string {
	t.Helper()
	var info struct{ Labels map[string]string }
	out := e.ctr(t, "containers", "info", id)
	if err := json.Unmarshal([]byte(out[strings.Index(out, "{"):]), &info); err != nil {
		t.Fatalf("ctr containers info %s: %v", id, err)
	}
	return info.Labels
}
