// Package ckptarchive reads containerd's checkpoint archives (what CRI and
// the kubelet write, and lazyfork export) as untrusted input: a tar,
// possibly gzipped, whose checkpoint/ entries are a CRIU image. Only plain
// names one level below checkpoint/ or checkpoint/parent/ are written, each
// created anew inside the destination (O_EXCL, no links followed); sparse
// entries, which expand a few archive bytes into gigabytes of zeros, are
// refused; the entries must fit a byte budget and an entry count.
package ckptarchive

import (
	"archive/tar"
	"bufio"
	"bytes"
	"compress/gzip"
	"errors"
	"fmt"
	"io"
	"os"
	"path"
	"path/filepath"
	"strings"

	"github.com/containerd/errdefs"
	"golang.org/x/sys/unix"
)

// CheckpointDir is the archive's directory holding the CRIU image.
const CheckpointDir = "checkpoint"

// ParentDir is the image's subdirectory of parent pagemaps: a rewrite gives a
// task whose mappings would need hundreds of open files at its restore an
// empty parent pagemap there, so that CRIU premaps them one file at a time
// (memfile's premap). Its plain files are taken too.
const ParentDir = "parent"

// MaxEntries bounds the checkpoint/ entries of one archive (CRIU writes a
// few per process).
const MaxEntries = 100000

// Open opens a (possibly gzipped) tar.
func Open(p string) (*tar.Reader, io.Closer, error) {
	f, err := os.Open(p)
	if err != nil {
		return nil, nil, err
	}
	br := bufio.NewReader(f)
	var r io.Reader = br
	if magic, _ := br.Peek(2); bytes.Equal(magic, []byte{0x1f, 0x8b}) {
		zr, err := gzip.NewReader(br)
		if err != nil {
			f.Close()
			return nil, nil, fmt.Errorf("%v: %w", err, errdefs.ErrInvalidArgument)
		}
		r = zr
	}
	return tar.NewReader(r), f, nil
}

// EntryName is a tar entry's clean relative name.
func EntryName(h *tar.Header) string {
	return path.Clean(strings.TrimPrefix(h.Name, "./"))
}

// Options says what Unpack may write and what else it reads.
type Options struct {
	// Budget is how many bytes the entries Unpack takes may hold in all.
	Budget int64
	// NoSpace is the error for an entry that does not fit the budget or
	// meets a full filesystem (nil: a plain ErrResourceExhausted).
	NoSpace func(entry string, size, budget int64) error
	// Extra reads top-level regular entries by name (e.g. the writable
	// layer, rootfs-diff.tar); their sizes count against the budget.
	Extra map[string]func(r io.Reader) error
}

// Unpack writes the regular files directly under checkpoint/ of the archive
// at p into dst and hands o.Extra its entries; everything else is skipped. It
// returns how many checkpoint/ entries it wrote.
func Unpack(p, dst string, o Options) (int, error) {
	tr, closer, err := Open(p)
	if err != nil {
		return 0, err
	}
	defer closer.Close()
	noSpace := func(entry string, size int64) error {
		if o.NoSpace != nil {
			return o.NoSpace(entry, size, o.Budget)
		}
		return fmt.Errorf("entry %q of %d bytes exceeds what is left of %d bytes: %w", entry, size, max(o.Budget, 0), errdefs.ErrResourceExhausted)
	}
	var total int64
	n := 0
	for {
		h, err := tr.Next()
		if errors.Is(err, io.EOF) {
			return n, nil
		}
		if err != nil {
			return n, fmt.Errorf("read: %v: %w", err, errdefs.ErrInvalidArgument)
		}
		name := EntryName(h)
		extra := o.Extra[name]
		dir, file := path.Split(name)
		dir = path.Clean(dir)
		inImage := (dir == CheckpointDir || dir == CheckpointDir+"/"+ParentDir) && file != "" && file != "." && file != ".."
		if extra == nil && !inImage {
			continue
		}
		sub := strings.TrimPrefix(strings.TrimPrefix(dir, CheckpointDir), "/")
		switch {
		case name == CheckpointDir+"/"+ParentDir && h.Typeflag == tar.TypeDir:
			// The parent pagemaps a rewrite gives a task with many mappings.
			if err := os.Mkdir(filepath.Join(dst, ParentDir), 0o700); err != nil && !errors.Is(err, os.ErrExist) {
				return n, err
			}
			continue
		case h.Typeflag == tar.TypeDir && inImage:
			continue
		case h.Typeflag != tar.TypeReg:
			return n, fmt.Errorf("entry %q is not a regular file: %w", h.Name, errdefs.ErrInvalidArgument)
		case sparse(h):
			return n, fmt.Errorf("entry %q is sparse; containerd never writes sparse checkpoint entries: %w", h.Name, errdefs.ErrInvalidArgument)
		case h.Size < 0 || h.Size > o.Budget-total:
			return n, noSpace(h.Name, h.Size)
		}
		total += h.Size
		if extra != nil {
			if err := extra(tr); err != nil {
				if errors.Is(err, unix.ENOSPC) {
					return n, noSpace(h.Name, h.Size)
				}
				return n, fmt.Errorf("%s: %w", name, err)
			}
			continue
		}
		if n++; n > MaxEntries {
			return n, fmt.Errorf("more than %d checkpoint entries: %w", MaxEntries, errdefs.ErrInvalidArgument)
		}
		if sub != "" {
			if err := os.Mkdir(filepath.Join(dst, sub), 0o700); err != nil && !errors.Is(err, os.ErrExist) {
				return n, err
			}
		}
		if err := writeEntry(filepath.Join(dst, sub, file), tr, h.Size); err != nil {
			if errors.Is(err, unix.ENOSPC) {
				return n, noSpace(h.Name, h.Size)
			}
			return n, fmt.Errorf("entry %q: %w", h.Name, err)
		}
	}
}

// writeEntry creates p anew (no link followed) with size bytes of r.
func writeEntry(p string, r io.Reader, size int64) error {
	out, err := os.OpenFile(p, os.O_WRONLY|os.O_CREATE|os.O_EXCL|unix.O_NOFOLLOW, 0o600)
	if err != nil {
		return err
	}
	_, err = io.CopyN(out, r, size)
	if cerr := out.Close(); err == nil {
		err = cerr
	}
	return err
}

// sparse reports whether a tar entry is a sparse file (old GNU or PAX form).
func sparse(h *tar.Header) bool {
	if h.Typeflag == tar.TypeGNUSparse {
		return true
	}
	for k := range h.PAXRecords {
		if strings.HasPrefix(k, "GNU.sparse.") {
			return true
		}
	}
	return false
}
