package testutil

import (
	"os"
	"os/exec"
	"strings"
	"testing"

	"github.com/lazyfork/lazyfork/internal/hwbreak"
)

// InCI reports whether the tests run under CI, where nothing may be skipped.
func InCI() bool { return os.Getenv("CI") == "true" }

// IntegrationEnabled reports whether tests that need the real stack should run.
func IntegrationEnabled() bool {
	return InCI() || os.Getenv("LAZYFORK_INTEGRATION") == "1"
}

// missing skips the test on a laptop and fails it under CI.
func missing(t testing.TB, format string, args ...any) {
	t.Helper()
	if InCI() {
		t.Fatalf("CI=true but "+format, args...)
	}
	t.Skipf(format, args...)
}

// Integration skips t unless integration tests are enabled.
func Integration(t testing.TB) {
	t.Helper()
	if !IntegrationEnabled() {
		t.Skip("integration test: set LAZYFORK_INTEGRATION=1 (make integration) to run")
	}
}

// RequiresRoot gates an integration test that needs root.
func RequiresRoot(t testing.TB) {
	t.Helper()
	Integration(t)
	if os.Geteuid() != 0 {
		missing(t, "test requires root")
	}
}

// RequiresBinary gates a test on an executable being on PATH and returns its path.
func RequiresBinary(t testing.TB, name string) string {
	t.Helper()
	RequiresRoot(t)
	p, err := exec.LookPath(name)
	if err != nil {
		missing(t, "%s not found on PATH (run `make deps`)", name)
	}
	return p
}

// RequiresCRIU gates a test on a working CRIU 4.x and returns its path.
func RequiresCRIU(t testing.TB) string {
	t.Helper()
	p := RequiresBinary(t, "criu")
	out, err := exec.Command(p, "--version").CombinedOutput()
	if err != nil || !strings.Contains(string(out), "Version: 4.") {
		missing(t, "criu at %s is not CRIU 4.x (%v): %s", p, err, out)
	}
	// Every CRIU the test starts, directly or through go-criu, would hang
	// where the host's breakpoints do not trap (hwbreak).
	if _, err := hwbreak.SetCRIUEnv(); err != nil {
		t.Logf("hardware breakpoint probe: %v", err)
	}
	return p
}
