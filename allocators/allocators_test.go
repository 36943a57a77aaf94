package allocators_test

import (
	"context"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/lazyfork/lazyfork/allocators"
	"github.com/lazyfork/lazyfork/internal/criurun"
	"github.com/lazyfork/lazyfork/internal/testutil"
	"github.com/lazyfork/lazyfork/memfile/madvguard"
)

func TestParseStatus(t *testing.T) {
	s, err := allocators.ParseStatus("churn t=3 ops=10 callocs=4 bad_calloc=1 bad_pattern=2")
	if err != nil || s != (allocators.Status{T: 3, Ops: 10, Callocs: 4, BadCalloc: 1, BadPattern: 2}) || s.Failures() != 3 {
		t.Fatalf("ParseStatus = %+v, %v", s, err)
	}
	for _, bad := range []string{"", "churn ready threads=2 mib=64", "churn t=1 ops=x callocs=1 bad_calloc=0 bad_pattern=0"} {
		if _, err := allocators.ParseStatus(bad); err == nil {
			t.Errorf("ParseStatus(%q) did not fail", bad)
		}
	}
	p := filepath.Join(t.TempDir(), "out")
	os.WriteFile(p, []byte("churn ready\nchurn t=1 ops=5 callocs=1 bad_calloc=0 bad_pattern=0\nchurn t=2 ops=9 callocs=2 bad_calloc=0 bad_pattern=0\nchurn t=3 ops=1"), 0o644)
	first, last, n, err := allocators.ReadStatus(p)
	if err != nil || n != 2 || first.Ops != 5 || last.Ops != 9 {
		t.Fatalf("ReadStatus = %+v %+v %d %v", first, last, n, err)
	}
}

// guardPlain guards a plain dump on every range that holds data.
func guardPlain(ctx context.Context, dir string, gen int) error {
	rs, err := madvguard.AnonRanges(dir)
	if err != nil {
		return err
	}
	return madvguard.Apply(dir, rs)
}

// Every allocator, dumped, guarded and restored as 3 forks watched for 30 s
// and a fork of a fork: zero failures anywhere, the guard in every copy.
func TestAllocatorsInForks(t *testing.T) {
	testutil.RequiresCRIU(t)
	testutil.RequiresBinary(t, "gcc")
	if err := criurun.BecomeSubreaper(); err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	bins, err := allocators.Build(ctx, t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	root := t.TempDir()
	var opts []allocators.RunOptions
	for _, cfg := range allocators.Configs {
		opts = append(opts, allocators.RunOptions{
			Config: cfg, Bins: bins, Dir: filepath.Join(root, cfg.Name),
			Prepare: guardPlain, Forks: 3, Warmup: 2 * time.Second,
			Watch: 30 * time.Second, ForkOfFork: true, WatchGrandchild: 10 * time.Second,
			Threads: 2, MiB: 48, YieldUs: 500,
		})
	}
	results, errs := allocators.RunAll(ctx, opts)
	for i, cfg := range allocators.Configs {
		t.Run(cfg.Name, func(t *testing.T) {
			if errs[i] != nil {
				t.Fatal(errs[i])
			}
			for _, c := range results[i].Copies {
				t.Log(c)
				if c.Role != "parent" && c.Filters < 1 {
					t.Errorf("%s: Seccomp_filters=%d, the guard is missing", c.Role, c.Filters)
				}
			}
			if err := results[i].Check(); err != nil {
				t.Error(err)
			}
		})
	}
}
