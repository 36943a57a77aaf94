package memfile

import (
	"testing"

	"github.com/checkpoint-restore/go-criu/v7/crit/images/vma"
	"golang.org/x/sys/unix"
)

// TestFileDataCandidate: only writable, non-executable, plain private file
// mappings (a .data) are candidates for conversion.
func TestFileDataCandidate(t *testing.T) {
	const (
		rw   = unix.PROT_READ | unix.PROT_WRITE
		file = vmaAreaRegular | vmaFilePrivate
	)
	for _, c := range []struct {
		name   string
		status uint32
		flags  uint32
		prot   uint32
		madv   uint64
		want   bool
	}{
		{".data", file, unix.MAP_PRIVATE, rw, 0, true},
		{"text", file, unix.MAP_PRIVATE, unix.PROT_READ | unix.PROT_EXEC, 0, false},
		{"writable text", file, unix.MAP_PRIVATE, rw | unix.PROT_EXEC, 0, false},
		{"relro", file, unix.MAP_PRIVATE, unix.PROT_READ, 0, false},
		{"shared file", vmaAreaRegular | vmaFileShared, unix.MAP_SHARED, rw, 0, false},
		{"anonymous", vmaAreaRegular | vmaAnonPrivate, unix.MAP_PRIVATE | unix.MAP_ANONYMOUS, rw, 0, false},
		{"memfd", file | vmaAreaMemfd, unix.MAP_PRIVATE, rw, 0, false},
		{"growsdown", file, unix.MAP_PRIVATE | unix.MAP_GROWSDOWN, rw, 0, false},
		{"hugetlb", file, unix.MAP_PRIVATE | unix.MAP_HUGETLB, rw, 0, false},
		{"wipeonfork", file, unix.MAP_PRIVATE, rw, 1 << unix.MADV_WIPEONFORK, false},
		{"not regular", vmaFilePrivate, unix.MAP_PRIVATE, rw, 0, false},
	} {
		v := &vma.VmaEntry{Status: ptr(c.status), Flags: ptr(c.flags), Prot: ptr(c.prot), Madv: ptr(c.madv)}
		if got := fileDataCandidate(v); got != c.want {
			t.Errorf("%s: candidate %v, want %v", c.name, got, c.want)
		}
	}
}
