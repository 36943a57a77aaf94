package criuimg

import (
	"errors"
	"fmt"
	"os"
	"sort"

	"github.com/checkpoint-restore/go-criu/v7/crit/images/pagemap"
	"github.com/containerd/errdefs"
	"google.golang.org/protobuf/proto"
)

// PageSize is the page size CRIU images use on x86-64.
const PageSize = 4096

// Pagemap entry flags (criu/include/pagemap.h).
const (
	PEParent  uint32 = 1 << 0 // pages are in the parent snapshot
	PELazy    uint32 = 1 << 1 // pages can be restored lazily
	PEPresent uint32 = 1 << 2 // pages are in pages-<id>.img
)

// Pagemap is a decoded pagemap-<pid>.img.
type Pagemap struct {
	Head    uint32 // head magic of the file (kept for re-encoding)
	PagesID uint32
	HeadMsg *pagemap.PagemapHead
	Entries []*pagemap.PagemapEntry
}

// ReadPagemap reads pagemap-<pid>.img.
func ReadPagemap(dir string, pid uint32) (*Pagemap, error) {
	path := PagemapPath(dir, pid)
	img, err := ReadImage(path, MagicPagemap, pagemapEntries)
	if err != nil {
		return nil, err
	}
	if len(img.Entries) == 0 {
		return nil, fmt.Errorf("%s: no pagemap head: %w", path, errdefs.ErrDataLoss)
	}
	pm := &Pagemap{Head: img.Head, HeadMsg: img.Entries[0].(*pagemap.PagemapHead)}
	pm.PagesID = pm.HeadMsg.GetPagesId()
	for _, e := range img.Entries[1:] {
		pm.Entries = append(pm.Entries, e.(*pagemap.PagemapEntry))
	}
	return pm, nil
}

// Image returns the pagemap as an encodable image.
func (pm *Pagemap) Image() *Image {
	img := &Image{Head: pm.Head, Magic: MagicPagemap}
	img.Entries = append(img.Entries, pm.HeadMsg)
	for _, e := range pm.Entries {
		img.Entries = append(img.Entries, e)
	}
	return img
}

// Flags returns an entry's flags, deriving them for images written before
// CRIU recorded flags (in_parent set: parent; otherwise present).
func Flags(e *pagemap.PagemapEntry) uint32 {
	if e.Flags != nil {
		return e.GetFlags()
	}
	if e.GetInParent() {
		return PEParent
	}
	return PEPresent
}

// NewEntry builds a present pagemap entry the way CRIU 4.1.1 writes them.
func NewPresentEntry(vaddr uint64, nrPages uint32) *pagemap.PagemapEntry {
	return &pagemap.PagemapEntry{Vaddr: proto.Uint64(vaddr), NrPages: proto.Uint32(nrPages), Flags: proto.Uint32(PEPresent)}
}

// Offsets returns, for every entry, the byte offset of its pages in
// pages-<id>.img, or -1 when its pages are not in that file; and the total
// number of bytes the entries account for.
func (pm *Pagemap) Offsets() ([]int64, int64) {
	offs := make([]int64, len(pm.Entries))
	var off int64
	for i, e := range pm.Entries {
		if Flags(e)&PEPresent == 0 {
			offs[i] = -1
			continue
		}
		offs[i] = off
		off += int64(e.GetNrPages()) * PageSize
	}
	return offs, off
}

// Pages is an open pages-<id>.img.
type Pages struct {
	*os.File
	Size int64
}

// OpenPages opens pages-<id>.img and checks it holds at least want bytes
// (from Pagemap.Offsets): a short pages file is an error, not zeros.
func OpenPages(dir string, id uint32, want int64) (*Pages, error) {
	path := PagesPath(dir, id)
	f, err := os.Open(path)
	if err != nil {
		if errors.Is(err, os.ErrNotExist) {
			if want == 0 {
				return &Pages{}, nil
			}
			return nil, fmt.Errorf("%s: %w", path, errdefs.ErrNotFound)
		}
		return nil, err
	}
	st, err := f.Stat()
	if err != nil {
		f.Close()
		return nil, err
	}
	if st.Size() < want {
		f.Close()
		return nil, fmt.Errorf("%s: truncated: %d bytes, pagemap needs %d: %w", path, st.Size(), want, errdefs.ErrDataLoss)
	}
	return &Pages{File: f, Size: st.Size()}, nil
}

// Close closes the file if one is open.
func (p *Pages) Close() error {
	if p == nil || p.File == nil {
		return nil
	}
	return p.File.Close()
}

// Index finds pages by address in a pagemap: built once, each lookup is a
// binary search.
type Index struct {
	vaddr []uint64
	pages []uint64
	off   []int64
}

// Index builds the lookup table of the entries whose pages are in the image.
func (pm *Pagemap) Index() *Index {
	offs, _ := pm.Offsets()
	ix := &Index{}
	for i, e := range pm.Entries {
		if offs[i] < 0 {
			continue
		}
		ix.vaddr = append(ix.vaddr, e.GetVaddr())
		ix.pages = append(ix.pages, uint64(e.GetNrPages()))
		ix.off = append(ix.off, offs[i])
	}
	return ix
}

// Lookup returns the offset in pages-<id>.img of the page at vaddr, and how
// many pages follow it contiguously in that entry (0 when the page is not in
// the image).
func (ix *Index) Lookup(vaddr uint64) (off int64, run uint64) {
	i := sort.Search(len(ix.vaddr), func(i int) bool { return ix.vaddr[i]+ix.pages[i]*PageSize > vaddr })
	if i == len(ix.vaddr) || ix.vaddr[i] > vaddr {
		return 0, 0
	}
	k := (vaddr - ix.vaddr[i]) / PageSize
	return ix.off[i] + int64(k*PageSize), ix.pages[i] - k
}
