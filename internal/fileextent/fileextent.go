package fileextent

import (
	"errors"
	"os"
	"sort"

	"golang.org/x/sys/unix"
)

// Extent is a byte range [Start, End) of a file that holds data.
type Extent struct{ Start, End int64 }

// Data lists the data extents of f, in order.
func Data(f *os.File) ([]Extent, error) {
	var out []Extent
	for pos := int64(0); ; {
		data, err := unix.Seek(int(f.Fd()), pos, unix.SEEK_DATA)
		if errors.Is(err, unix.ENXIO) {
			return out, nil // holes to the end of the file
		}
		if err != nil {
			return nil, err
		}
		hole, err := unix.Seek(int(f.Fd()), data, unix.SEEK_HOLE)
		if err != nil {
			return nil, err
		}
		out = append(out, Extent{data, hole})
		pos = hole
	}
}

// From is the index of the first of ext that ends after off.
func From(ext []Extent, off int64) int {
	return sort.Search(len(ext), func(i int) bool { return ext[i].End > off })
}
