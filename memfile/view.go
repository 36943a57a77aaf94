package memfile

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"os"
	"path/filepath"

	"github.com/containerd/errdefs"
	"golang.org/x/sys/unix"

	"github.com/lazyfork/lazyfork/api"
)

// viewsDirName holds the per-container views, beside the family directories.
const viewsDirName = ".views"

// viewMarkers, in a family's state directory, holds one empty file per view
// that links files of the family: the family (and its owner) is kept while
// one of those views exists.
const viewMarkers = "views"

// ViewName returns the name of the view of container id in containerd
// namespace namespace: 32 hex digits of sha256(namespace + "/" + id)
// (namespaces hold no '/', so two containers never share a name).
func ViewName(namespace, id string) string {
	h := sha256.Sum256([]byte(namespace + "/" + id))
	return hex.EncodeToString(h[:16])
}

// ViewDir returns the directory of a view: <root>/.views/<view>.
func (s *Store) ViewDir(view string) string { return filepath.Join(s.root, viewsDirName, view) }

func checkView(view string) error {
	if !api.ValidName(view) {
		return fmt.Errorf("bad view name %q: %w", view, errdefs.ErrInvalidArgument)
	}
	return nil
}

func (s *Store) viewMarker(family, view string) string {
	return filepath.Join(s.stateDir(family), viewMarkers, view)
}

// LinkView makes the named files of family (base names) visible in a view: a
// directory of hard links, which a container gets instead of the whole
// family directory, so it sees only the memory files of its own lineage.
// The view directory (0755) is created if absent. Links share the family
// file's inode (and page cache); a sealed file is unsealed for the link and
// sealed again. Idempotent: an existing link to the same inode is kept, any
// other entry of that name is replaced; other entries of the view (e.g. a
// file the shim put there) are left alone. Every file must exist in the
// family (errdefs.ErrNotFound otherwise). Returns the view directory.
func (s *Store) LinkView(family, view string, files []string) (string, error) {
	if err := checkFamily(family); err != nil {
		return "", err
	}
	if err := checkView(view); err != nil {
		return "", err
	}
	for _, f := range files {
		if err := checkFileName(f); err != nil {
			return "", err
		}
	}
	unlock, err := s.lockFamily(family)
	if err != nil {
		return "", err
	}
	defer unlock()
	dir := s.ViewDir(view)
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return "", fmt.Errorf("view %s: %w", view, err)
	}
	// The marker first: from now on GC keeps the family while the view exists.
	if err := os.MkdirAll(filepath.Dir(s.viewMarker(family, view)), 0o700); err != nil {
		return "", fmt.Errorf("view %s: %w", view, err)
	}
	if err := os.WriteFile(s.viewMarker(family, view), nil, 0o600); err != nil {
		return "", fmt.Errorf("view %s: %w", view, err)
	}
	famDir := filepath.Join(s.root, family)
	for _, f := range files {
		src, dst := filepath.Join(famDir, f), filepath.Join(dir, f)
		var ss, ds unix.Stat_t
		if err := unix.Lstat(src, &ss); err != nil || ss.Mode&unix.S_IFMT != unix.S_IFREG {
			return "", fmt.Errorf("view %s: memory file %s of family %s: %w", view, f, family, errdefs.ErrNotFound)
		}
		if err := unix.Lstat(dst, &ds); err == nil {
			if ds.Dev == ss.Dev && ds.Ino == ss.Ino {
				continue
			}
			if err := removeSealed(dst); err != nil {
				return "", fmt.Errorf("view %s: replace %s: %w", view, f, err)
			}
		}
		if err := linkSealed(src, dst); err != nil {
			return "", fmt.Errorf("view %s: link memory file %s of family %s: %w", view, f, family, err)
		}
	}
	return dir, nil
}

// RemoveView removes a view directory and everything in it (sealed links
// included; the family's files keep their seal); no error if it is absent.
// A family left with no files, holders or views is then collected (see GC).
func (s *Store) RemoveView(view string) error {
	if err := checkView(view); err != nil {
		return err
	}
	if err := RemoveAll(s.ViewDir(view)); err != nil {
		return fmt.Errorf("remove view %s: %w", view, err)
	}
	markers, _ := filepath.Glob(filepath.Join(s.root, stateDirName, "*", viewMarkers, view))
	var errs []error
	for _, m := range markers {
		family := filepath.Base(filepath.Dir(filepath.Dir(m)))
		if checkFamily(family) != nil {
			continue
		}
		unlock, err := s.lockFamily(family)
		if err != nil {
			errs = append(errs, err)
			continue
		}
		if err := os.Remove(s.viewMarker(family, view)); err != nil && !errors.Is(err, os.ErrNotExist) {
			errs = append(errs, err)
		}
		if _, err := s.gcLocked(context.Background(), family); err != nil {
			errs = append(errs, err)
		}
		unlock()
	}
	return errors.Join(errs...)
}
