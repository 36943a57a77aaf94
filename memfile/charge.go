package memfile

import (
	"errors"
	"os"
	"path/filepath"
	"strings"

	"github.com/lazyfork/lazyfork/internal/atomicfile"
)

// Where a memory file's pages are charged. The kernel charges a tmpfs page to
// the memory cgroup of the process that first writes it: a rewrite's files
// to the family's shim, a moved container's file to that container (the
// move's helper joins its memory cgroup). The writer records it here, for the
// tools (lazyfork mem); GC drops the record with the file.

func (s *Store) chargesDir(family string) string {
	return filepath.Join(s.stateDir(family), "charges")
}

func (s *Store) chargePath(family, file string) string {
	return filepath.Join(s.chargesDir(family), file)
}

// SetCharge records the memory cgroup the pages of a family's file are
// charged to.
func (s *Store) SetCharge(family, file, cgroup string) error {
	if err := checkFamily(family); err != nil {
		return err
	}
	if err := checkFileName(file); err != nil {
		return err
	}
	p := s.chargePath(family, file)
	if err := os.MkdirAll(filepath.Dir(p), 0o700); err != nil {
		return err
	}
	return atomicfile.WriteFile(p, []byte(cgroup+"\n"), 0o600)
}

// Charges returns the recorded memory cgroup of each file of a family that
// has one.
func (s *Store) Charges(family string) (map[string]string, error) {
	if err := checkFamily(family); err != nil {
		return nil, err
	}
	dir := s.chargesDir(family)
	ents, err := os.ReadDir(dir)
	if errors.Is(err, os.ErrNotExist) {
		return nil, nil
	}
	if err != nil {
		return nil, err
	}
	out := map[string]string{}
	for _, e := range ents {
		if b, err := os.ReadFile(filepath.Join(dir, e.Name())); err == nil {
			out[e.Name()] = strings.TrimSpace(string(b))
		}
	}
	return out, nil
}
