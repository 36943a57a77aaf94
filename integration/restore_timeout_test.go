package integration

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/containerd/containerd/v2/pkg/oci"

	lfclient "github.com/lazyfork/lazyfork/client"
	"github.com/lazyfork/lazyfork/integration/harness"
	"github.com/lazyfork/lazyfork/shim"
)

// TestRestoreTimeout: a restore that never finishes is killed by the shim
// after LAZYFORK_RESTORE_TIMEOUT and cleaned up; the fork call fails clearly,
// the parent keeps running, nothing of the fork is left (issue 19, point 8).
// The hang is deterministic: a CRIU action script (named by the parent's
// org.criu.config, which its forks inherit) sleeps at CRIU's pre-resume stage
// of every restore, in the fork's cgroup, where the spinning restore of a
// corrupt image was seen.
func TestRestoreTimeout(t *testing.T) {
	dir := t.TempDir()
	script := filepath.Join(dir, "hang.sh")
	if err := os.WriteFile(script, []byte("#!/bin/sh\n[ \"$CRTOOLS_SCRIPT_ACTION\" = pre-resume ] && exec sleep 600\nexit 0\n"), 0o755); err != nil {
		t.Fatal(err)
	}
	conf := filepath.Join(dir, "criu.conf")
	if err := os.WriteFile(conf, []byte("verbosity=1\naction-script "+script+"\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	e := startLF(t, harness.Options{Env: []string{"LAZYFORK_RESTORE_TIMEOUT=5s"}})
	ctx := e.ctx(t)
	img, err := e.ImportImage(ctx, "python")
	if err != nil {
		t.Fatal(err)
	}
	id := "hang-" + lfRandom(3)
	_, task := e.run(t, ctx, img, id, pyHold(8, ""), oci.WithAnnotations(map[string]string{shim.AnnotationCRIUConfig: conf}))
	parent := &counter{e: e, id: id, task: task}
	parent.waitLine(t, ctx, 0, "tick 3")

	fid := "hung-" + lfRandom(3)
	t0 := time.Now()
	_, err = e.lfClient().Fork(ctx, id, 1, lfclient.WithIDs(fid), e.logIO())
	took := time.Since(t0)
	if err == nil || !strings.Contains(err.Error(), "LAZYFORK_RESTORE_TIMEOUT") {
		t.Fatalf("fork with a restore that hangs: %v after %v, want the shim's restore timeout", err, took)
	}
	t.Logf("fork failed after %v: %v", took, err)
	e.assertNothingLeft(t, ctx, id, "", []string{fid})
	if got := e.snapshotsLeft(t); len(got) != 0 {
		t.Errorf("snapshots left: %v", got)
	}
	parent.waitLine(t, ctx, len(parent.lines(t)), "tick ")
}
