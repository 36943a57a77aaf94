//go:build linux

package snapshotter

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/containerd/containerd/v2/core/snapshots"
	"github.com/containerd/containerd/v2/core/snapshots/storage"
	"github.com/containerd/containerd/v2/core/snapshots/testsuite"
	"github.com/containerd/containerd/v2/pkg/namespaces"
	"github.com/containerd/errdefs"

	"github.com/lazyfork/lazyfork/internal/testutil"
)

func TestSnapshotterSuite(t *testing.T) {
	testutil.RequiresRoot(t)
	// The suite keys overlayfs's known limit (renaming a lower directory
	// gives EXDEV without redirect_dir, as with containerd's overlay) on
	// the name "overlayfs"; that is what we are.
	testsuite.SnapshotterSuite(t, "overlayfs", func(ctx context.Context, root string) (snapshots.Snapshotter, func() error, error) {
		s, err := New(ctx, root)
		if err != nil {
			return nil, nil, err
		}
		return s, s.Close, nil
	})
}

func newTestSnapshotter(t *testing.T) (context.Context, *Snapshotter) {
	t.Helper()
	ctx := namespaces.WithNamespace(context.Background(), "lazyfork-test")
	s, err := New(ctx, t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { s.Close() })
	return ctx, s
}

// A freeze through containerd names its source inside the caller's namespace;
// the backend sees "<ns>/<n>/<key>" and must find the right one.
func TestFreezeSourceResolution(t *testing.T) {
	ctx, s := newTestSnapshotter(t)
	mustPrepare := func(key, parent string) {
		t.Helper()
		if _, err := s.Prepare(ctx, key, parent); err != nil {
			t.Fatalf("prepare %s: %v", key, err)
		}
	}
	mustPrepare("ns1/1/base-tmp", "")
	if err := s.Commit(ctx, "ns1/2/base", "ns1/1/base-tmp"); err != nil {
		t.Fatal(err)
	}
	mustPrepare("ns1/3/ctr", "ns1/2/base")
	mustPrepare("ns2/4/ctr", "ns1/2/base") // same name, other namespace
	if err := os.WriteFile(filepath.Join(s.upperPath(mustID(t, s, ctx, "ns1/3/ctr")), "mark"), []byte("ns1"), 0o644); err != nil {
		t.Fatal(err)
	}

	// A stale backend copy of the same key, older than the live one (its
	// containerd record is gone, containerd's GC has not run yet).
	mustPrepare("ns1/0/ctr", "ns1/2/base")
	label := func(v string) snapshots.Opt {
		return snapshots.WithLabels(map[string]string{FreezeSourceLabel: v})
	}
	if _, err := s.Prepare(ctx, "ns1/5/frz", "ns1/2/base", label("ctr")); err != nil {
		t.Fatalf("freeze by namespaced name: %v", err)
	}
	b, err := os.ReadFile(filepath.Join(s.upperPath(mustID(t, s, ctx, "ns1/5/frz")), "mark"))
	if err != nil || string(b) != "ns1" {
		t.Fatalf("frozen layer holds %q, %v; want the ns1 source's file", b, err)
	}

	for _, c := range []struct {
		name, key, parent, source string
		want                      error
	}{
		{"unknown source", "ns1/6/a", "ns1/2/base", "nope", errdefs.ErrNotFound},
		{"wrong parent", "ns1/7/b", "", "ctr", errdefs.ErrInvalidArgument},
		{"committed source", "ns1/8/c", "", "ns1/2/base", errdefs.ErrInvalidArgument},
		{"empty source", "ns1/9/d", "ns1/2/base", "", errdefs.ErrInvalidArgument},
	} {
		_, err := s.Prepare(ctx, c.key, c.parent, label(c.source))
		if !errors.Is(err, c.want) {
			t.Errorf("%s: got %v, want %v", c.name, err, c.want)
		}
		if _, err := s.Stat(ctx, c.key); !errdefs.IsNotFound(err) {
			t.Errorf("%s: failed prepare left %q behind (%v)", c.name, c.key, err)
		}
	}
	if _, err := s.View(ctx, "ns1/10/v", "ns1/2/base", label("ctr")); !errdefs.IsInvalidArgument(err) {
		t.Errorf("freeze label on View: got %v, want invalid argument", err)
	}
	assertNoStrayDirs(t, s)
}

func mustID(t *testing.T, s *Snapshotter, ctx context.Context, key string) string {
	t.Helper()
	var id string
	err := s.ms.WithTransaction(ctx, false, func(ctx context.Context) error {
		var err error
		id, _, _, err = storage.GetInfo(ctx, key)
		return err
	})
	if err != nil {
		t.Fatalf("id of %s: %v", key, err)
	}
	return id
}

// assertNoStrayDirs checks that disk and metadata agree exactly.
func assertNoStrayDirs(t *testing.T, s *Snapshotter) {
	t.Helper()
	ctx := context.Background()
	var orphans []string
	if err := s.ms.WithTransaction(ctx, true, func(ctx context.Context) error {
		ids, err := storage.IDMap(ctx)
		if err != nil {
			return err
		}
		entries, err := os.ReadDir(s.snapshotsDir())
		if err != nil {
			return err
		}
		for _, e := range entries {
			if _, ok := ids[e.Name()]; !ok {
				orphans = append(orphans, e.Name())
			}
		}
		return nil
	}); err != nil {
		t.Fatal(err)
	}
	if len(orphans) > 0 {
		t.Errorf("directories without a record: %s", strings.Join(orphans, ", "))
	}
	missing, err := s.missingDirs(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if len(missing) > 0 {
		t.Errorf("records without a directory: %v", missing)
	}
}

// A crash leaves new-* directories and removed snapshots' directories; the
// next start removes them and nothing else.
func TestReconcileOnStart(t *testing.T) {
	ctx := namespaces.WithNamespace(context.Background(), "lazyfork-test")
	root := t.TempDir()
	s, err := New(ctx, root)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := s.Prepare(ctx, "keep", ""); err != nil {
		t.Fatal(err)
	}
	keepID := mustID(t, s, ctx, "keep")
	if err := os.WriteFile(filepath.Join(s.upperPath(keepID), "data"), []byte("x"), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := s.Close(); err != nil {
		t.Fatal(err)
	}
	for _, d := range []string{"new-123", "999"} {
		if err := os.MkdirAll(filepath.Join(root, "snapshots", d, "fs"), 0o755); err != nil {
			t.Fatal(err)
		}
	}
	s, err = New(ctx, root)
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	entries, err := os.ReadDir(filepath.Join(root, "snapshots"))
	if err != nil {
		t.Fatal(err)
	}
	if len(entries) != 1 || entries[0].Name() != keepID {
		t.Fatalf("after restart snapshots/ holds %v, want only %s", entries, keepID)
	}
	if b, err := os.ReadFile(filepath.Join(s.upperPath(keepID), "data")); err != nil || string(b) != "x" {
		t.Fatalf("kept snapshot lost its data: %q %v", b, err)
	}
	st, err := s.Status(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if st.Active != 1 || len(st.Missing) != 0 {
		t.Fatalf("status after restart: %+v", st)
	}
}
