package memfile

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"

	"github.com/containerd/errdefs"
	"golang.org/x/sys/unix"
)

// The points of a rewrite at which a test may inject a fault (Store.faultAt):
// the rewrite fails there as if that step had failed, or (a hook that does
// not return) dies there. Each names the state reached.
const (
	faultWritten    = "written"    // the memory file is complete under its flocked .tmp- name
	faultStaged     = "staged"     // the new image is complete in its staging directory
	faultNamed      = "named"      // the memory file has its final name, not yet sealed
	faultSealed     = "sealed"     // the memory file is sealed
	faultHooked     = "hooked"     // RewriteOptions.Stage has run
	faultReferenced = "referenced" // the snapshot's holder is recorded
	faultExchanged  = "exchanged"  // the new image is in place, the old one at the staging path
)

// faultPoints lists the fault points in the order a rewrite reaches them.
var faultPoints = []string{faultWritten, faultStaged, faultNamed, faultSealed, faultHooked, faultReferenced, faultExchanged}

// fault calls the test's fault hook at point, if one is set.
func (s *Store) fault(point string) error {
	if s.faultAt == nil {
		return nil
	}
	if err := s.faultAt(point); err != nil {
		return fmt.Errorf("fault injected at %s: %w", point, err)
	}
	return nil
}

// commitRewrite makes the rewrite visible (phase 5, the store's part): under
// the family lock, the memory file gets its final name and is sealed
// (immutable, see Seal), the Stage hook runs, the new snapshot's reference is
// recorded, and the staged image is swapped with the image directory in one
// atomic rename (RENAME_EXCHANGE). The old image then sits at the staging
// path and is removed. On error the caller aborts mf and st; nothing else is
// left (a reference it recorded is dropped).
func (s *Store) commitRewrite(ctx context.Context, d *dump, mf *memFile, st *staged) error {
	if err := s.fault(faultStaged); err != nil {
		return err
	}
	unlock, err := s.lockFamily(d.opts.Family)
	if err != nil {
		return err
	}
	defer unlock()
	if p := mf.file; p != nil {
		final := filepath.Join(d.famDir, p.name)
		if err := os.Rename(p.path, final); err != nil {
			return err
		}
		p.path = final // an abort from here on removes it (removeSealed)
		if err := s.fault(faultNamed); err != nil {
			return err
		}
		// Forks map the file from now on: nobody, root included, may write,
		// truncate, rename or unlink it (16 flipped bytes would change
		// running forks, a truncation kill them with SIGBUS). Only the
		// store unseals it, to link it into a view or to free it.
		if err := setImmutable(int(p.f.Fd()), final, true); err != nil {
			return err
		}
		if err := s.fault(faultSealed); err != nil {
			return err
		}
	}
	if d.opts.Stage != nil {
		if err := d.opts.Stage(ctx, st.dir); err != nil {
			return fmt.Errorf("stage hook: %w", err)
		}
	}
	if err := s.fault(faultHooked); err != nil {
		return err
	}
	// A previous snapshot's patch file the image maps again may have been
	// freed since it was read (GC takes the family lock too: from here on
	// nothing frees it).
	for _, name := range st.info.Files {
		f := d.opened[name]
		if f == nil {
			continue
		}
		var a, b unix.Stat_t
		if unix.Fstat(int(f.Fd()), &a) != nil || unix.Stat(filepath.Join(d.famDir, name), &b) != nil || a.Ino != b.Ino || a.Dev != b.Dev {
			return fmt.Errorf("memory file %s was freed during the rewrite (rewrite again): %w", name, errdefs.ErrAborted)
		}
	}
	holder := d.opts.Holder
	if holder == "" {
		holder = HolderSnapshot + d.dir
	}
	if err := s.refLocked(d.opts.Family, holder, "", st.info.Files); err != nil {
		return err
	}
	// Every directory the swap touches must agree with the holder record
	// before the swap (a crash between the two leaves a dead holder, since
	// the image directory has no lazyfork.json yet, and GC frees the file).
	err = ctx.Err()
	if err == nil {
		err = s.fault(faultReferenced)
	}
	if err != nil {
		s.dropRefLocked(d.opts.Family, holder, d.opts.Holder == "")
		return err
	}
	if err := unix.Renameat2(unix.AT_FDCWD, st.dir, unix.AT_FDCWD, d.dir, unix.RENAME_EXCHANGE); err != nil {
		s.dropRefLocked(d.opts.Family, holder, d.opts.Holder == "")
		if errors.Is(err, unix.EINVAL) || errors.Is(err, unix.ENOSYS) {
			return fmt.Errorf("atomic swap of %s (renameat2 RENAME_EXCHANGE): %v: %w", d.dir, err, errdefs.ErrNotImplemented)
		}
		return fmt.Errorf("swap %s: %w", d.dir, err)
	}
	if mf.file != nil {
		mf.file.done = true // part of the snapshot: no abort removes it
		mf.file.f.Close()
	}
	// The old image now sits at the staging path. The snapshot is in place
	// whatever happens next (a fault here can only be a crash); a leftover
	// is removed by the next Rewrite of the directory.
	s.fault(faultExchanged)
	old := st.dir
	st.dir = ""
	os.RemoveAll(old)
	return nil
}

// dropRefLocked undoes refLocked for a holder created by a rewrite that then
// failed. A caller-supplied holder may hold other files: only a
// rewrite-made snapshot holder is removed. Preconditions: family lock held.
func (s *Store) dropRefLocked(family, holder string, ours bool) {
	if ours {
		os.Remove(s.refPath(family, holder))
	}
}
