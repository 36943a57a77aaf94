package madvguard

import (
	"fmt"

	"github.com/lazyfork/lazyfork/criuimg"
	"golang.org/x/sys/unix"
)

// CRIU VMA status bits (criu/include/image.h).
const (
	vmaRegular     = 1 << 0
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
