package integration

import (
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/lazyfork/lazyfork/integration/harness"
	"github.com/lazyfork/lazyfork/internal/testutil"
)

// TestDepsChecksAreStable runs `make deps`'s checks (scripts/deps.sh in dry-run
// mode) eight times on a machine where everything is installed: every run must
// find every step present and propose nothing. Before the fix, `runc --version |
// grep -q` under pipefail exited 141 whenever grep finished before runc had
// written its four lines, and runc was reinstalled at random while containers ran.
func TestDepsChecksAreStable(t *testing.T) {
	testutil.RequiresCRIU(t)
	testutil.RequiresBinary(t, "runc")
	repo, err := harness.RepoRoot()
	if err != nil {
		t.Fatal(err)
	}
	script := filepath.Join(repo, "scripts", "deps.sh")
	// A machine that lacks something legitimately needs an install: only test
	// stability once a first dry run says all is present.
	run := func() string {
		cmd := exec.Command("bash", script)
		cmd.Env = append(os.Environ(), "LAZYFORK_DEPS_DRY_RUN=1")
		out, err := cmd.CombinedOutput()
		if err != nil {
			t.Fatalf("deps.sh (dry run): %v\n%s", err, out)
		}
		return string(out)
	}
	first := run()
	if strings.Contains(first, " would ") {
		if testutil.InCI() {
			t.Fatalf("CI=true but the machine needs `make deps` first:\n%s", first)
		}
		t.Skipf("this machine needs `make deps` first:\n%s", first)
	}
	for i := 0; i < 8; i++ {
		out := run()
		for _, line := range strings.Split(out, "\n") {
			if strings.Contains(line, " would ") {
				t.Errorf("run %d: deps.sh would reinstall on a complete machine: %q", i+1, line)
			}
		}
		if !strings.Contains(out, "deps: runc ") {
			t.Errorf("run %d: no runc step in output:\n%s", i+1, out)
		}
	}
}
