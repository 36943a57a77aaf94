package memfile

import (
	"cmp"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"

	"golang.org/x/sys/unix"

	"github.com/lazyfork/lazyfork/internal/fileextent"
)

// FileRange is a byte range of a memory file.
type FileRange struct {
	File     string // base name in the family directory
	Off, Len uint64
}

// PunchUnused frees the pages of ranges of a family's files that nothing
// can read any more, and returns how many bytes it freed. A running
// container that moved the pages it wrote onto a new file no longer reads
// the older file there; when every live holder of that file is the
// container itself (own reports which holders are: its moved files, its
// restore), no snapshot or other container can read those pages either, yet
// the file keeps them until it goes. A range is punched only where no
// process on the host maps the file (checked under the family's lock, which
// every new reference takes), so a page still in use is never dropped; the
// file is unsealed for the punch and sealed again.
func (s *Store) PunchUnused(family string, own func(holder string) bool, ranges []FileRange) (int64, error) {
	if len(ranges) == 0 {
		return 0, nil
	}
	unlock, err := s.lockFamily(family)
	if err != nil {
		return 0, err
	}
	defer unlock()
	recs, err := s.records(family)
	if err != nil {
		return 0, err
	}
	foreign := map[string]bool{}
	for _, r := range recs {
		if !s.alive(family, r) || own(r.Holder) {
			continue
		}
		for _, f := range r.Files {
			foreign[f] = true
		}
	}
	byFile := map[string][][2]uint64{}
	for _, r := range ranges {
		if checkFileName(r.File) != nil || foreign[r.File] {
			continue
		}
		lo := (r.Off + pageSize - 1) &^ (pageSize - 1)
		hi := (r.Off + r.Len) &^ (pageSize - 1)
		if hi > lo {
			byFile[r.File] = append(byFile[r.File], [2]uint64{lo, hi})
		}
	}
	if len(byFile) == 0 {
		return 0, nil
	}
	dir := filepath.Join(s.root, family)
	cands := map[fileKey]string{}
	for f := range byFile {
		var st unix.Stat_t
		if err := unix.Stat(filepath.Join(dir, f), &st); err != nil {
			delete(byFile, f)
			continue
		}
		cands[fileKey{dev: st.Dev, ino: st.Ino}] = f
	}
	// What any process still maps stays.
	eachMapping(cands, func(k fileKey, off, n uint64) {
		f := cands[k]
		byFile[f] = subtract(byFile[f], off, off+n)
	})
	var freed int64
	for f, rs := range byFile {
		if len(rs) == 0 {
			continue
		}
		n, err := punchFile(filepath.Join(dir, f), rs)
		freed += n
		if err != nil {
			return freed, fmt.Errorf("free unused pages of %s: %w", f, err)
		}
	}
	return freed, nil
}

// UnmappedData returns the bytes of data (allocated pages) of the files at
// paths that no process on the host maps: what a family's files hold that
// only a snapshot image can still read, or nothing at all (the pages a move
// replaced, once freed, are not counted).
func UnmappedData(paths []string) (int64, error) {
	cands := map[fileKey]string{}
	data := map[fileKey][][2]uint64{}
	for _, p := range paths {
		f, err := os.Open(p)
		if errors.Is(err, os.ErrNotExist) {
			continue // removed meanwhile: nothing left to count
		}
		if err != nil {
			return 0, err
		}
		var st unix.Stat_t
		err = unix.Fstat(int(f.Fd()), &st)
		var ext []fileextent.Extent
		if err == nil {
			ext, err = fileextent.Data(f)
		}
		f.Close()
		if err != nil {
			return 0, fmt.Errorf("%s: %w", p, err)
		}
		k := fileKey{dev: st.Dev, ino: st.Ino}
		cands[k] = p
		for _, e := range ext {
			data[k] = append(data[k], [2]uint64{uint64(e.Start), uint64(e.End)})
		}
	}
	eachMapping(cands, func(k fileKey, off, n uint64) {
		data[k] = subtract(data[k], off, off+n)
	})
	var n int64
	for _, rs := range data {
		for _, r := range rs {
			n += int64(r[1] - r[0])
		}
	}
	return n, nil
}

// subtract removes [lo, hi) from the ranges rs.
func subtract(rs [][2]uint64, lo, hi uint64) [][2]uint64 {
	if hi < lo { // overflow of an unreadable mapping's length
		hi = ^uint64(0)
	}
	var out [][2]uint64
	for _, r := range rs {
		if hi <= r[0] || lo >= r[1] {
			out = append(out, r)
			continue
		}
		if r[0] < lo {
			out = append(out, [2]uint64{r[0], lo})
		}
		if hi < r[1] {
			out = append(out, [2]uint64{hi, r[1]})
		}
	}
	return out
}

// punchFile deallocates the page ranges rs of path (a sealed memory file:
// unsealed for the punch, sealed again) and returns the bytes it freed.
func punchFile(path string, rs [][2]uint64) (int64, error) {
	var before unix.Stat_t
	if err := unix.Stat(path, &before); err != nil {
		return 0, err
	}
	sealed, _, err := isSealed(path)
	if err != nil {
		return 0, err
	}
	if sealed {
		if err := Unseal(path); err != nil {
			return 0, err
		}
		defer Seal(path)
	}
	f, err := os.OpenFile(path, os.O_WRONLY|unix.O_NOFOLLOW, 0)
	if err != nil {
		return 0, err
	}
	defer f.Close()
	slices.SortFunc(rs, func(a, b [2]uint64) int { return cmp.Compare(a[0], b[0]) })
	for _, r := range rs {
		if err := unix.Fallocate(int(f.Fd()), unix.FALLOC_FL_PUNCH_HOLE|unix.FALLOC_FL_KEEP_SIZE, int64(r[0]), int64(r[1]-r[0])); err != nil {
			return 0, err
		}
	}
	var after unix.Stat_t
	if err := unix.Fstat(int(f.Fd()), &after); err != nil {
		return 0, nil
	}
	return (before.Blocks - after.Blocks) * 512, nil
}
