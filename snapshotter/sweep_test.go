//go:build linux

package snapshotter

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"path/filepath"
	"sync"
	"testing"

	"github.com/containerd/containerd/v2/core/snapshots/storage"
)

// freezeSetup makes a committed base and an active snapshot "parent" on it
// whose upper dir holds files, and returns the files' content by path.
func freezeSetup(t *testing.T, ctx context.Context, s *Snapshotter, parent string) map[string]string {
	t.Helper()
	if _, err := s.Stat(ctx, "base"); err != nil {
		_, err := s.Prepare(ctx, "base-extract", "")
		must(t, err)
		writeFile(t, filepath.Join(s.upperPath(mustID(t, s, ctx, "base-extract")), "etc/base"), bytes.NewReader([]byte("base")))
		must(t, s.Commit(ctx, "base", "base-extract"))
	}
	_, err := s.Prepare(ctx, parent, "base")
	must(t, err)
	files := map[string]string{}
	for i := range 20 {
		rel := fmt.Sprintf("d%d/f%d", i%4, i)
		files[rel] = fmt.Sprintf("%s written by %s", rel, parent)
		writeFile(t, filepath.Join(s.upperPath(mustID(t, s, ctx, parent)), rel), bytes.NewReader([]byte(files[rel])))
	}
	return files
}

// checkFrozen asserts that the frozen layer key holds files.
func checkFrozen(t *testing.T, ctx context.Context, s *Snapshotter, key string, files map[string]string) {
	t.Helper()
	if err := frozenHolds(ctx, s, key, files); err != nil {
		t.Error(err)
	}
}

func frozenHolds(ctx context.Context, s *Snapshotter, key string, files map[string]string) error {
	var id string
	if err := s.ms.WithTransaction(ctx, false, func(ctx context.Context) (err error) {
		id, _, _, err = storage.GetInfo(ctx, key)
		return err
	}); err != nil {
		return fmt.Errorf("frozen layer %s: %w", key, err)
	}
	for rel, want := range files {
		if b, err := os.ReadFile(filepath.Join(s.upperPath(id), rel)); err != nil || string(b) != want {
			return fmt.Errorf("frozen layer %s: %s = %q, %v; want %q", key, rel, b, err, want)
		}
	}
	return nil
}

// A freeze copies into its snapshot's directory outside any transaction.
// Remove's orphan sweep and Cleanup, run by another caller while it copies,
// must leave it alone (issue 19: forks failed with "no such file or
// directory" when they did not).
func TestSweepSparesFreezeInConstruction(t *testing.T) {
	ctx, s := newTestSnapshotter(t)
	files := freezeSetup(t, ctx, s, "parent")
	_, err := s.Prepare(ctx, "victim", "base")
	must(t, err)
	victimDir := filepath.Dir(s.upperPath(mustID(t, s, ctx, "victim")))

	var (
		once  sync.Once
		swept bool
	)
	testHookPrecopy = func(td string) {
		// Outside a transaction, so another caller may take the write
		// lock here.
		once.Do(func() {
			swept = true
			if err := s.Remove(ctx, "victim"); err != nil {
				t.Errorf("concurrent remove: %v", err)
			}
			if err := s.Cleanup(ctx); err != nil {
				t.Errorf("concurrent cleanup: %v", err)
			}
			if !exists(td) {
				t.Errorf("the sweeps removed %s, which a freeze is building", td)
			}
		})
	}
	t.Cleanup(func() { testHookPrecopy = func(string) {} })

	if _, err := s.Freeze(ctx, "parent", "frozen"); err != nil {
		t.Fatalf("freeze with a concurrent remove and cleanup: %v", err)
	}
	if !swept {
		t.Fatal("the hook never ran: the freeze copied nothing")
	}
	checkFrozen(t, ctx, s, "frozen", files)
	if exists(victimDir) {
		t.Errorf("the removed snapshot's directory %s is still there", victimDir)
	}
	assertNoStrayDirs(t, s)
}

// Many freezes, forks, removes and cleanups at once, as a busy node does:
// every call succeeds and disk and metadata agree at the end.
func TestConcurrentFreezeAndRemove(t *testing.T) {
	ctx, s := newTestSnapshotter(t)
	const (
		workers = 4
		rounds  = 15
	)
	parents := make([]map[string]string, workers)
	for w := range workers {
		parents[w] = freezeSetup(t, ctx, s, fmt.Sprintf("parent-%d", w))
	}
	errs := make(chan error, 3*workers*rounds)
	var wg sync.WaitGroup
	for w := range workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for r := range rounds {
				frozen := fmt.Sprintf("frozen-%d-%d", w, r)
				if _, err := s.Freeze(ctx, fmt.Sprintf("parent-%d", w), frozen); err != nil {
					errs <- fmt.Errorf("freeze %s: %w", frozen, err)
					return
				}
				if err := frozenHolds(ctx, s, frozen, parents[w]); err != nil {
					errs <- err
					return
				}
				fork := fmt.Sprintf("fork-%d-%d", w, r)
				if _, err := s.Prepare(ctx, fork, frozen); err != nil {
					errs <- fmt.Errorf("prepare %s: %w", fork, err)
					return
				}
				for _, key := range []string{fork, frozen} {
					if err := s.Remove(ctx, key); err != nil {
						errs <- fmt.Errorf("remove %s: %w", key, err)
						return
					}
				}
			}
		}()
		wg.Add(1)
		go func() {
			defer wg.Done()
			for r := range rounds {
				key := fmt.Sprintf("other-%d-%d", w, r)
				if _, err := s.Prepare(ctx, key, "base"); err != nil {
					errs <- fmt.Errorf("prepare %s: %w", key, err)
					return
				}
				if err := s.Remove(ctx, key); err != nil {
					errs <- fmt.Errorf("remove %s: %w", key, err)
					return
				}
				if err := s.Cleanup(ctx); err != nil {
					errs <- fmt.Errorf("cleanup: %w", err)
					return
				}
			}
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}
	assertNoStrayDirs(t, s)
}
