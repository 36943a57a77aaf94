// Package memloop runs LazyFork's memory loop on plain process trees: dump a running
// tree with CRIU, rewrite the dump so its private memory lives in a family's files on
// tmpfs (memfile), and restore copies that map those files. With no store it runs
// plain CRIU instead, the baseline LazyFork is measured against.
//
// It is shared by the developer tool (cmd/lazyfork-memfile), the fidelity tests and
// the memfile benchmark, so all three exercise one code path.
package memloop

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"sync"
	"time"

	"golang.org/x/sys/unix"

	"github.com/lazyfork/lazyfork/internal/criurun"
	"github.com/lazyfork/lazyfork/internal/procfs"
	"github.com/lazyfork/lazyfork/memfile"
	"github.com/lazyfork/lazyfork/memfile/madvguard"
)

// Loop holds where a family's memory lives. The zero value (no Store) is plain CRIU.
type Loop struct {
	Store  *memfile.Store // nil: no rewrite, restores copy every page
	Family string
	MapDir string // the family's host directory, recorded in images as is
	Criu   string // criu binary; "" = criurun.DefaultBinary()
	// Guard adds madvguard's Refuse-mode seccomp filter to every snapshot, atomically
	// with the rewrite: in copies, purging madvise calls on memory-file ranges that
	// hold data fail with EINVAL instead of bringing back the file's bytes.
	Guard bool
	// Patch rewrites the snapshots of a process that already runs on the
	// family's files as patched deltas (memfile.RewriteOptions.Patch), each
	// reusing the patches of that process's previous snapshot.
	Patch bool

	patches map[int][]memfile.Patch // by root PID: its last snapshot's
	root    string
	mounted bool // Open mounted the tmpfs at root, so Close unmounts it
}

// Open prepares a memfile loop: a tmpfs at root (mounted unless root already is
// one, with sizeBytes as its limit), the store on it, and the family's directory.
func Open(root, family string, sizeBytes int64) (*Loop, error) {
	if err := os.MkdirAll(root, 0o755); err != nil {
		return nil, err
	}
	was, err := isTmpfs(root)
	if err != nil {
		return nil, err
	}
	if err := memfile.EnsureTmpfs(root, sizeBytes); err != nil {
		return nil, fmt.Errorf("tmpfs at %s: %w", root, err)
	}
	l := &Loop{Family: family, root: root, mounted: !was}
	if l.Store, err = memfile.OpenStore(root); err != nil {
		l.Close()
		return nil, err
	}
	if l.MapDir, err = l.Store.FamilyDir(family); err != nil {
		l.Close()
		return nil, err
	}
	return l, nil
}

// Close unmounts the tmpfs Open mounted (lazily: a copy still running keeps its
// files). Call it after the copies are gone.
func (l *Loop) Close() error {
	if !l.mounted {
		return nil
	}
	l.mounted = false
	if err := unix.Unmount(l.root, unix.MNT_DETACH); err != nil && !errors.Is(err, unix.EINVAL) {
		return fmt.Errorf("unmount %s: %w", l.root, err)
	}
	return nil
}

func isTmpfs(dir string) (bool, error) {
	var st unix.Statfs_t
	if err := unix.Statfs(dir, &st); err != nil {
		return false, fmt.Errorf("statfs %s: %w", dir, err)
	}
	return st.Type == unix.TMPFS_MAGIC, nil
}

// Snapshot is a dump, rewritten unless the loop is plain.
type Snapshot struct {
	Dir        string
	Dump       *criurun.DumpResult
	Rewrite    *memfile.Result // nil for plain CRIU
	ImageBytes int64           // what the image directory holds afterwards
}

// Snapshot dumps the tree rooted at pid into dir (leaving it running) and rewrites it.
func (l *Loop) Snapshot(ctx context.Context, pid int, dir string) (*Snapshot, error) {
	dir, err := filepath.Abs(dir)
	if err != nil {
		return nil, err
	}
	// The tree runs during the dump: what is wipe-on-fork before or after
	// it covers what the dump saw (see memfile.ReadWipeOnFork).
	var wipe memfile.WipeOnFork
	if l.Store != nil {
		if wipe, err = memfile.ReadWipeOnFork(pid); err != nil {
			return nil, err
		}
	}
	d, err := criurun.Dump(ctx, pid, dir, criurun.DumpOptions{Criu: l.Criu})
	if err != nil {
		return nil, err
	}
	s := &Snapshot{Dir: dir, Dump: d}
	if l.Store != nil {
		after, err := memfile.ReadWipeOnFork(pid)
		if err != nil {
			return nil, err
		}
		if s.Rewrite, err = l.rewritePatched(ctx, dir, wipe.Merge(after), pid); err != nil {
			return nil, err
		}
	}
	s.ImageBytes, err = dirBytes(dir)
	return s, err
}

// Rewrite turns the dump in dir into a snapshot of the loop's family.
func (l *Loop) Rewrite(ctx context.Context, dir string) (*memfile.Result, error) {
	return l.rewrite(ctx, dir, nil)
}

func (l *Loop) rewrite(ctx context.Context, dir string, wipe memfile.WipeOnFork) (*memfile.Result, error) {
	return l.rewritePatched(ctx, dir, wipe, 0)
}

// rewritePatched is rewrite of a snapshot of the tree of pid, patched when
// Patch is set.
func (l *Loop) rewritePatched(ctx context.Context, dir string, wipe memfile.WipeOnFork, pid int) (*memfile.Result, error) {
	if l.Store == nil {
		return nil, fmt.Errorf("rewrite %s: plain loop has no store", dir)
	}
	opts := memfile.RewriteOptions{Family: l.Family, MapDir: l.MapDir, FileRoot: "/", WipeOnFork: wipe}
	if l.Guard {
		opts.Stage = func(ctx context.Context, staging string) error {
			// The hook runs with the new memory file at its final path.
			ranges, err := madvguard.DataRanges(staging, l.MapDir, l.MapDir)
			if err != nil {
				return err
			}
			return madvguard.ApplyMode(staging, ranges, madvguard.Refuse)
		}
	}
	if l.Patch && pid != 0 {
		// (A tree not yet on the family's files has nothing to patch.)
		opts.Patch = &memfile.PatchOptions{Previous: l.patches[pid]}
	}
	r, err := l.Store.Rewrite(ctx, dir, opts)
	if err != nil {
		return nil, fmt.Errorf("rewrite %s: %w", dir, err)
	}
	if opts.Patch != nil {
		if l.patches == nil {
			l.patches = map[int][]memfile.Patch{}
		}
		l.patches[pid] = r.Patches
	}
	return r, nil
}

// Copy is a restored copy.
type Copy struct {
	PID     int
	Out     string        // its stdout and stderr
	Restore time.Duration // wall time of its criu restore
	// CRIU's own account (stats-restore): its restore_time, and the pages it
	// copied from the image into the copy.
	CRIUTime      time.Duration
	PagesRestored uint64
	holder        string
}

// Restore restores one copy per entry of outs at once, each writing to its own
// file. On any failure the copies already restored are killed.
func (l *Loop) Restore(ctx context.Context, dir string, outs []string) ([]*Copy, time.Duration, error) {
	var files []string
	if l.Store != nil {
		info, err := memfile.ReadSnapshot(dir)
		if err != nil {
			return nil, 0, err
		}
		files = info.Files
	}
	copies := make([]*Copy, len(outs))
	errs := make([]error, len(outs))
	var wg sync.WaitGroup
	start := time.Now()
	for i, out := range outs {
		wg.Add(1)
		go func() {
			defer wg.Done()
			r, err := criurun.Restore(ctx, dir, criurun.RestoreOptions{Criu: l.Criu, Stdout: out})
			if err != nil {
				errs[i] = err
				return
			}
			copies[i] = &Copy{PID: r.PID, Out: out, Restore: r.Duration, CRIUTime: r.CRIUTime, PagesRestored: r.PagesRestored}
		}()
	}
	wg.Wait()
	wall := time.Since(start)
	if err := errors.Join(errs...); err != nil {
		l.Kill(copies...)
		return nil, wall, err
	}
	for _, c := range copies {
		if !procfs.Alive(c.PID) {
			l.Kill(copies...)
			return nil, wall, fmt.Errorf("copy %d of %s died right after its restore (was the original started with a parent-death signal, e.g. `unshare --kill-child`? CRIU restores it, and CRIU exits): its output: %s",
				c.PID, dir, c.Out)
		}
	}
	// A running copy maps its snapshot's files: it holds them in the store too.
	if l.Store != nil {
		for _, c := range copies {
			c.holder = memfile.HolderPID + strconv.Itoa(c.PID)
			if err := l.Store.Ref(l.Family, c.holder, files); err != nil {
				l.Kill(copies...)
				return nil, wall, err
			}
		}
	}
	return copies, wall, nil
}

// Kill stops copies (SIGKILL, reaped when the caller is their subreaper) and drops
// their holds on the family's files. Nil entries are skipped.
func (l *Loop) Kill(copies ...*Copy) error {
	var errs []error
	for _, c := range copies {
		if c == nil {
			continue
		}
		errs = append(errs, criurun.Kill(c.PID))
		if c.holder != "" && l.Store != nil {
			errs = append(errs, l.Store.Unref(l.Family, c.holder))
			c.holder = ""
		}
	}
	return errors.Join(errs...)
}

// Release drops a snapshot's own hold on its files (the default holder Rewrite
// records) and removes its directory.
func (l *Loop) Release(s *Snapshot) error {
	var err error
	if l.Store != nil && s.Rewrite != nil {
		err = l.Store.Unref(l.Family, memfile.HolderSnapshot+s.Dir)
	}
	return errors.Join(err, os.RemoveAll(s.Dir))
}

func dirBytes(dir string) (int64, error) {
	var n int64
	err := filepath.WalkDir(dir, func(p string, d os.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if fi, err := d.Info(); err == nil && fi.Mode().IsRegular() {
			n += fi.Size()
		}
		return nil
	})
	return n, err
}
