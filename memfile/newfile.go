package memfile

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"time"

	"github.com/containerd/errdefs"
	"golang.org/x/sys/unix"
)

// PendingFile is a memory file written outside a rewrite: the move of a
// running container onto a file of its family (package rehome). Like a
// rewrite's file it is written under a flocked .tmp- name, so GC removes it
// if its writer dies; Publish gives it its final name and records its
// holder, Seal makes it immutable once written.
type PendingFile struct {
	store  *Store
	family string
	name   string
	path   string // the .tmp- path until Publish, then the final one
	f      *os.File
	holder string // set by Publish
	done   bool
}

// CreateFile starts a new memory file of family, empty, mode 0400, open for
// writing. Call Publish then Seal, or Abort.
func (s *Store) CreateFile(family string) (*PendingFile, error) {
	dir, err := s.FamilyDir(family)
	if err != nil {
		return nil, err
	}
	name := fmt.Sprintf("%s-%s%s", time.Now().UTC().Format("20060102T150405"), randHex(6), FileExt)
	p := &PendingFile{store: s, family: family, name: name, path: filepath.Join(dir, tmpPrefix+name)}
	// As in a rewrite: the flock is taken under the family lock, which GC
	// holds while it looks, so GC never sees the file unlocked.
	unlock, err := s.lockFamily(family)
	if err != nil {
		return nil, err
	}
	defer unlock()
	f, err := os.OpenFile(p.path, os.O_RDWR|os.O_CREATE|os.O_EXCL, 0o400)
	if err != nil {
		return nil, fmt.Errorf("new memory file of family %s: %w", family, err)
	}
	if err := unix.Flock(int(f.Fd()), unix.LOCK_EX); err != nil {
		f.Close()
		os.Remove(p.path)
		return nil, fmt.Errorf("new memory file of family %s: %w", family, err)
	}
	p.f = f
	return p, nil
}

// File is the open file, for writing.
func (p *PendingFile) File() *os.File { return p.f }

// Name is the file's final base name in the family directory.
func (p *PendingFile) Name() string { return p.name }

// Publish gives the file its final name and records that holder pins it,
// without sealing it: it may still be written (by a move that maps it chunk
// by chunk as it writes). Seal it when written; Abort drops holder.
func (p *PendingFile) Publish(holder string) error {
	if p.done || p.holder != "" {
		return fmt.Errorf("memory file %s: already published: %w", p.name, errdefs.ErrFailedPrecondition)
	}
	unlock, err := p.store.lockFamily(p.family)
	if err != nil {
		return err
	}
	defer unlock()
	final := filepath.Join(filepath.Dir(p.path), p.name)
	if err := os.Rename(p.path, final); err != nil {
		return err
	}
	p.path = final
	if err := p.store.refLocked(p.family, holder, "", []string{p.name}); err != nil {
		os.Rename(final, filepath.Join(filepath.Dir(final), tmpPrefix+p.name))
		return err
	}
	p.holder = holder
	return nil
}

// Path is the file's path on the host.
func (p *PendingFile) Path() string { return p.path }

// Seal makes a published file immutable and closes it.
func (p *PendingFile) Seal() error {
	if p.done || p.holder == "" {
		return fmt.Errorf("memory file %s: not published: %w", p.name, errdefs.ErrFailedPrecondition)
	}
	p.done = true
	if err := setImmutable(int(p.f.Fd()), p.path, true); err != nil {
		p.f.Close()
		return err
	}
	return p.f.Close()
}

// Abort removes a file that was not published; a published one is only
// unreferenced (GC frees it once no process maps it). It is a no-op after
// Seal.
func (p *PendingFile) Abort() {
	if p.done {
		return
	}
	if p.holder != "" {
		p.done = true
		p.f.Close()
		p.store.Unref(p.family, p.holder)
		return
	}
	p.done = true
	p.f.Close()
	if err := removeSealed(p.path); err != nil && !errors.Is(err, os.ErrNotExist) {
		os.Remove(p.path)
	}
}
