package fileextent

import (
	"os"
	"path/filepath"
	"testing"
)

// Data finds a file's data around a hole, and From the extent an offset
// falls in or before.
func TestData(t *testing.T) {
	f, err := os.Create(filepath.Join(t.TempDir(), "f"))
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	const mb = 1 << 20
	for _, off := range []int64{0, 3 * mb} { // data, a 2 MiB hole, data
		if _, err := f.WriteAt(make([]byte, mb), off); err != nil {
			t.Fatal(err)
		}
	}
	// Data is written as zeros: the file system keeps the blocks.
	ext, err := Data(f)
	if err != nil {
		t.Fatal(err)
	}
	if len(ext) != 2 || ext[0].Start != 0 || ext[0].End < mb || ext[0].End > 3*mb || ext[1].Start > 3*mb || ext[1].End != 4*mb {
		t.Fatalf("extents %v, want data at [0, 1 MiB) and [3, 4 MiB)", ext)
	}
	for off, want := range map[int64]int{0: 0, mb - 1: 0, ext[0].End: 1, 4*mb - 1: 1, 4 * mb: 2} {
		if got := From(ext, off); got != want {
			t.Errorf("From(%d) = %d, want %d", off, got, want)
		}
	}
}
