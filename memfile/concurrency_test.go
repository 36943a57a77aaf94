package memfile_test

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"sync"
	"testing"

	"github.com/lazyfork/lazyfork/memfile"
)

// TestRewriteWhileGC: rewrites of one family run at once while GC runs in a
// loop; every snapshot keeps its files and restores.
func TestRewriteWhileGC(t *testing.T) {
	e := newEnv(t)
	orig := e.dump(e.start(16, 1))
	ctx, cancel := context.WithCancel(context.Background())
	var gcs sync.WaitGroup
	gcs.Add(1)
	go func() {
		defer gcs.Done()
		for ctx.Err() == nil {
			if _, err := e.store.GC(ctx); err != nil {
				t.Error(err)
				return
			}
		}
	}()
	const n = 4
	dirs := make([]string, n)
	var wg sync.WaitGroup
	for i := range dirs {
		dirs[i] = filepath.Join(e.tmp, fmt.Sprintf("conc-%d", i))
		copyDir(t, orig, dirs[i])
		wg.Add(1)
		go func(dir string) {
			defer wg.Done()
			if _, err := e.store.Rewrite(context.Background(), dir, memfile.RewriteOptions{Family: e.family, MapDir: e.famDir}); err != nil {
				t.Error(err)
			}
		}(dirs[i])
	}
	wg.Wait()
	cancel()
	gcs.Wait()
	for _, d := range dirs {
		info, err := memfile.ReadSnapshot(d)
		if err != nil {
			t.Fatal(err)
		}
		for _, f := range info.Files {
			if _, err := os.Stat(filepath.Join(e.famDir, f)); err != nil {
				t.Fatalf("%s lost %s", d, f)
			}
		}
	}
	e.verifyTree(e.restore(dirs[n-1]))
	// Dropping a snapshot frees exactly its file.
	os.RemoveAll(dirs[0])
	freed, err := e.store.GC(context.Background())
	if err != nil || len(freed) != 1 {
		t.Fatalf("GC after removing one snapshot freed %v (%v)", freed, err)
	}
}
