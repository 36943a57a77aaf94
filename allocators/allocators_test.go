package allocators_test

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/lazyfork/lazyfork/allocators"
	"github.com/lazyfork/lazyfork/internal/criurun"
	"github.com/lazyfork/lazyfork/internal/testutil"
	"github.com/lazyfork/lazyfork/memfile"
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

func TestMain(m *testing.M) {
	madvguard.MaybeServe() // supervisors run as re-executions of the test binary
	allocators.MaybeServeMove()
	os.Exit(m.Run())
}

// Every allocator, dumped, rewritten into memory files and restored as 3
// forks watched for 30 s and a fork of a fork, in both guard modes: zero
// failures anywhere. Without the guard jemalloc must fail: that proves the
// hazard is real, so a regression cannot pass silently. Everything runs at
// once to keep the test near a minute.
func TestAllocatorsInForks(t *testing.T) {
	testutil.RequiresCRIU(t)
	testutil.RequiresBinary(t, "gcc")
	if err := criurun.BecomeSubreaper(); err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	tmp := t.TempDir()
	bins, err := allocators.Build(ctx, filepath.Join(tmp, "bin"))
	if err != nil {
		t.Fatal(err)
	}
	memRoot := filepath.Join(tmp, "mem")
	if err := memfile.EnsureTmpfs(memRoot, 8<<30); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { unix.Unmount(memRoot, unix.MNT_DETACH) })
	store, err := memfile.OpenStore(memRoot)
	if err != nil {
		t.Fatal(err)
	}
	refuse, zero := madvguard.Refuse, madvguard.Zero
	type run struct {
		name string
		opts allocators.RunOptions
	}
	var runs []run
	add := func(name string, cfg allocators.Config, mode *madvguard.Mode, forks int, fof bool) *allocators.RunOptions {
		family := fmt.Sprintf("t%d-%s", os.Getpid(), strings.ReplaceAll(name, "/", "-"))
		prep, err := allocators.MemfilePrepare(store, family, mode)
		if err != nil {
			t.Fatal(err)
		}
		runs = append(runs, run{name, allocators.RunOptions{
			Config: cfg, Bins: bins, Dir: filepath.Join(tmp, strings.ReplaceAll(name, "/", "-")),
			Prepare: prep, Forks: forks, Warmup: 2 * time.Second,
			Watch: 30 * time.Second, ForkOfFork: fof, WatchGrandchild: 10 * time.Second,
			Threads: 2, MiB: 32, YieldUs: 1000, Supervise: mode != nil && *mode == zero,
		}})
		return &runs[len(runs)-1].opts
	}
	for _, cfg := range allocators.Configs {
		add(cfg.Name+"/refuse", cfg, &refuse, 3, true)
		add(cfg.Name+"/zero", cfg, &zero, 3, true)
		// The parent moved onto a memory file first, as a LazyFork
		// container at its first snapshot (zero mode keeps the old path:
		// its supervisor traces the task), then dumped as a delta.
		o := add(cfg.Name+"/refuse-moved", cfg, &refuse, 3, true)
		o.Move = allocators.MovePrepare(store, fmt.Sprintf("t%d-%s-refuse-moved", os.Getpid(), cfg.Name), refuse)
	}
	add("jemalloc/unguarded", allocators.Configs[1], nil, 1, false)

	opts := make([]allocators.RunOptions, len(runs))
	for i := range runs {
		opts[i] = runs[i].opts
	}
	results, errs := allocators.RunAll(ctx, opts)
	for i, r := range runs {
		t.Run(r.name, func(t *testing.T) {
			if errs[i] != nil {
				t.Fatal(errs[i])
			}
			for _, c := range results[i].Copies {
				t.Log(c)
			}
			err := results[i].Check()
			if r.opts.Prepare != nil && strings.HasSuffix(r.name, "/unguarded") {
				// The hazard: stale bytes in callocs of the unguarded fork.
				fork := results[i].Copies[1]
				if fork.Last.BadCalloc == 0 {
					t.Errorf("unguarded jemalloc fork saw no stale calloc: the hazard the guard exists for did not show (%v)", fork)
				}
				return
			}
			if err != nil {
				t.Error(err)
			}
			for _, c := range results[i].Copies {
				if (c.Role != "parent" || r.opts.Move != nil) && c.Filters < 1 {
					t.Errorf("%s: Seccomp_filters=%d, the guard is missing", c.Role, c.Filters)
				}
				if r.opts.Supervise && c.Role != "parent" && c.Sup == nil {
					t.Errorf("%s: no supervisor stats", c.Role)
				}
			}
		})
	}
}
