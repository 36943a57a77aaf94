package workloads_test

import (
	"context"
	"path/filepath"
	"testing"
	"time"

	"github.com/lazyfork/lazyfork/internal/criurun"
	"github.com/lazyfork/lazyfork/internal/testutil"
	"github.com/lazyfork/lazyfork/internal/workloads"
)

func TestOutputParsing(t *testing.T) {
	dir := t.TempDir()
	p := filepath.Join(dir, "out")
	if err := writeFile(p, "ready x\ntick 5 bad=0\ntick 6 bad=0\nverify tick=6 ok=1 marker=9\ntick 7 bad=0\ntick 8"); err != nil {
		t.Fatal(err)
	}
	o := workloads.Output(p)
	if f, l := o.Ticks(); f != 5 || l != 7 {
		t.Fatalf("ticks %d..%d, want 5..7 (half line ignored)", f, l)
	}
	vs := o.Reports("verify")
	if len(vs) != 1 || !vs[0].OK() || vs[0].Uint("marker") != 9 {
		t.Fatalf("verify reports: %+v", vs)
	}
}

// Each workload builds, runs in its own PID namespace, and answers verify and
// marker requests with a clean check (the programs themselves are right before
// anything is dumped).
func TestWorkloadsRunAndVerify(t *testing.T) {
	testutil.RequiresRoot(t)
	testutil.RequiresBinary(t, "gcc")
	for _, k := range workloads.Kinds {
		t.Run(string(k), func(t *testing.T) {
			ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
			defer cancel()
			dir := t.TempDir()
			cmd, err := workloads.Command(ctx, k, dir, 16, 50)
			if err != nil {
				t.Fatal(err)
			}
			out := workloads.Output(filepath.Join(dir, "out"))
			w, err := criurun.Start(cmd, criurun.StartOptions{Stdout: string(out)})
			if err != nil {
				t.Fatal(err)
			}
			defer w.Kill()
			if err := out.WaitTicks(ctx, 3); err != nil {
				t.Fatal(err)
			}
			v, err := out.Verify(ctx, w.PID)
			if err != nil || !v.OK() || v.Uint("marker") != 0 {
				t.Fatalf("verify: %v %v", v, err)
			}
			m, err := out.Mark(ctx, w.PID)
			if err != nil || m == 0 {
				t.Fatalf("mark: %d %v", m, err)
			}
			v, err = out.Verify(ctx, w.PID)
			if err != nil || !v.OK() || v.Uint("marker") != m {
				t.Fatalf("verify after marker %d: %v %v", m, v, err)
			}
		})
	}
}
