package harness_test

import (
	"os"
	"strings"
	"testing"

	"github.com/lazyfork/lazyfork/integration/harness"
	"github.com/lazyfork/lazyfork/internal/testutil"
)

// TestStartStop starts and stops an empty private containerd and checks that the
// daemon answered and that nothing it made outlives Stop.
func TestStartStop(t *testing.T) {
	testutil.RequiresBinary(t, "containerd")
	c, err := harness.Start(t.Context(), harness.Options{})
	if err != nil {
		t.Fatal(err)
	}
	v, err := c.Client().Version(c.Context(t.Context()))
	if err != nil {
		t.Fatalf("version: %v\n%s", err, c.Log())
	}
	if !strings.HasPrefix(v.Version, "v2.") {
		t.Errorf("containerd version %q, want v2.x", v.Version)
	}
	if err := c.Stop(); err != nil {
		t.Fatalf("stop: %v", err)
	}
	if _, err := os.Stat(c.Dir); !os.IsNotExist(err) {
		t.Errorf("harness dir %s still exists (%v)", c.Dir, err)
	}
	if pids := harness.ShimPIDs(c.Address); len(pids) > 0 {
		t.Errorf("shims still running: %v", pids)
	}
}

func TestConfigWithEveryOption(t *testing.T) {
	// The generated config must be accepted by containerd with every option set.
	testutil.RequiresBinary(t, "containerd")
	c := harness.StartT(t, harness.Options{
		EnableCRI:    true,
		BinDirs:      []string{t.TempDir()},
		Runtimes:     []harness.Runtime{{Name: "lazyfork", Type: "io.containerd.lazyfork.v1", PodAnnotations: []string{"lazyfork.io/*"}}},
		ProxyPlugins: []harness.ProxyPlugin{{Name: "lazyfork", Address: "/nonexistent/lazyfork.sock", ExportsRoot: "/nonexistent"}},
		ExtraTOML:    "[plugins.'io.containerd.gc.v1.scheduler']\n  pause_threshold = 0.02",
	})
	if _, err := c.Client().Version(c.Context(t.Context())); err != nil {
		t.Fatal(err)
	}
}
