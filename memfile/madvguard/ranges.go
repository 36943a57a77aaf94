package madvguard

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"

	"github.com/containerd/errdefs"

	"github.com/lazyfork/lazyfork/criuimg"
	"golang.org/x/sys/unix"
)

// CRIU VMA status bits (criu/include/image.h).
const (
	vmaRegular     = 1 << 0
	vmaFilePrivate = 1 << 6
	vmaAnonPrivate = 1 << 9
	vmaSkip        = 1<<1 | 1<<2 | 1<<3 | 1<<12 | 1<<15 | 1<<16 // stack, vsyscall, vdso, vvar, shadow stack, guard
)

// AnonRanges returns, per live process of a plain CRIU dump, the private
// anonymous ranges that hold pages in the image: exactly what a memory-file
// rewrite turns into file mappings (stack, vdso and vvar stay anonymous).
// It serves dumps that have not been rewritten (tests, and callers that
// rewrite without their own range list).
func AnonRanges(imageDir string) (map[int][]Range, error) {
	st, err := load(imageDir)
	if err != nil {
		return nil, err
	}
	out := map[int][]Range{}
	for _, p := range st.procs {
		m, err := criuimg.ReadMM(imageDir, uint32(p.pid))
		if err != nil {
			return nil, fmt.Errorf("madvguard: %w", err)
		}
		pm, err := criuimg.ReadPagemap(imageDir, uint32(p.pid))
		if err != nil {
			return nil, fmt.Errorf("madvguard: %w", err)
		}
		var vmas []Range
		for _, v := range m.MM.GetVmas() {
			s := v.GetStatus()
			if s&vmaRegular == 0 || s&vmaAnonPrivate == 0 || s&vmaSkip != 0 || v.GetFlags()&unix.MAP_GROWSDOWN != 0 {
				continue
			}
			vmas = append(vmas, Range{v.GetStart(), v.GetEnd()})
		}
		var rs []Range
		for _, e := range pm.Entries {
			d := Range{e.GetVaddr(), e.GetVaddr() + uint64(e.GetNrPages())*criuimg.PageSize}
			for _, v := range vmas {
				if r := (Range{max(d.Start, v.Start), min(d.End, v.End)}); r.End > r.Start {
					rs = append(rs, r)
				}
			}
		}
		if len(rs) > 0 {
			out[p.pid] = rs
		}
	}
	return out, nil
}

// DataRanges returns, per live process of a rewritten image, the address
// ranges of its private mappings of memory files that hold data: every VMA
// mapping a file recorded under mapDir (as the restored task sees it), read
// from hostDir on this host, clipped to the file's data extents
// (SEEK_DATA/SEEK_HOLE; holes read as zeros anyway). It covers the mappings
// of every generation, so a copy of a copy is guarded on all of them.
func DataRanges(imageDir, mapDir, hostDir string) (map[int][]Range, error) {
	st, err := load(imageDir)
	if err != nil {
		return nil, err
	}
	files, err := criuimg.ReadFiles(imageDir)
	if err != nil {
		return nil, fmt.Errorf("madvguard: %w", err)
	}
	names := map[uint64]string{}
	prefix := strings.TrimSuffix(mapDir, "/") + "/"
	for _, f := range files.Entries {
		if reg := f.GetReg(); reg != nil {
			if rel, ok := strings.CutPrefix(reg.GetName(), prefix); ok {
				if rel == "" || strings.Contains(rel, "/") || rel == "." || rel == ".." {
					return nil, fmt.Errorf("madvguard: odd memory file name %q: %w", reg.GetName(), errdefs.ErrInvalidArgument)
				}
				names[uint64(reg.GetId())] = rel
			}
		}
	}
	extents := map[string][]Range{} // file offsets holding data, per file
	out := map[int][]Range{}
	for _, p := range st.procs {
		m, err := criuimg.ReadMM(imageDir, uint32(p.pid))
		if err != nil {
			return nil, fmt.Errorf("madvguard: %w", err)
		}
		var rs []Range
		for _, v := range m.MM.GetVmas() {
			rel, ok := names[v.GetShmid()]
			if !ok || v.GetStatus()&vmaFilePrivate == 0 {
				continue
			}
			ext, ok := extents[rel]
			if !ok {
				if ext, err = dataExtents(filepath.Join(hostDir, rel)); err != nil {
					return nil, err
				}
				extents[rel] = ext
			}
			off, size := v.GetPgoff(), v.GetEnd()-v.GetStart()
			for _, e := range ext {
				s, t := max(e.Start, off), min(e.End, off+size)
				if t > s {
					rs = append(rs, Range{v.GetStart() + s - off, v.GetStart() + t - off})
				}
			}
		}
		if len(rs) > 0 {
			out[p.pid] = rs
		}
	}
	return out, nil
}

// dataExtents lists the byte ranges of a file that hold data.
func dataExtents(path string) ([]Range, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, fmt.Errorf("madvguard: memory file: %w", err)
	}
	defer f.Close()
	fi, err := f.Stat()
	if err != nil {
		return nil, err
	}
	var out []Range
	for off := int64(0); off < fi.Size(); {
		d, err := unix.Seek(int(f.Fd()), off, unix.SEEK_DATA)
		if errors.Is(err, unix.ENXIO) {
			break
		}
		if err != nil {
			return nil, fmt.Errorf("madvguard: SEEK_DATA in %s: %w", path, err)
		}
		h, err := unix.Seek(int(f.Fd()), d, unix.SEEK_HOLE)
		if err != nil {
			return nil, fmt.Errorf("madvguard: SEEK_HOLE in %s: %w", path, err)
		}
		out = append(out, Range{uint64(d), uint64(h)})
		off = h
	}
	return out, nil
}
