package main

import (
	"bytes"
	"context"
	"strings"
	"testing"
	"time"

	"github.com/lazyfork/lazyfork/internal/testutil"
	"github.com/lazyfork/lazyfork/internal/workloads"
)

// The whole loop on the built-in Go workload (the C one also checks that
// growing a converted VMA reads zeros, not a neighbour's bytes,
// which the fidelity tests cover): two generations of two copies, each copy
// checked by the workload itself.
func TestRunBuiltinWorkload(t *testing.T) {
	testutil.RequiresCRIU(t)
	for _, plain := range []bool{false, true} {
		cfg := &config{workload: workloads.Go, heapMiB: 16, settle: 500 * time.Millisecond, n: 2, generations: 2,
			family: "devtool-test", tmpfsSize: 1 << 30, verify: true, plain: plain, guard: !plain, work: t.TempDir()}
		var out bytes.Buffer
		if err := run(context.Background(), cfg, &out); err != nil {
			t.Fatalf("plain=%v: %v\n%s", plain, err, out.String())
		}
		// Four copy rows, every one checked ok.
		if n := strings.Count(out.String(), " ok\n"); n != 4 {
			t.Errorf("plain=%v: %d copies checked ok, want 4:\n%s", plain, n, out.String())
		}
		t.Logf("plain=%v:\n%s", plain, out.String())
	}
}
