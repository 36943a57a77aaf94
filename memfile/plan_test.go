package memfile

import (
	"testing"

	"github.com/checkpoint-restore/go-criu/v7/crit/images/fdinfo"
	sk_inet "github.com/checkpoint-restore/go-criu/v7/crit/images/sk-inet"
	"github.com/checkpoint-restore/go-criu/v7/crit/images/vma"
	"github.com/lazyfork/lazyfork/criuimg"
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

// TestHoldsTCPConnections: only a TCP socket CRIU must repair (neither
// listening nor closed) keeps the network lock of a restore.
func TestHoldsTCPConnections(t *testing.T) {
	inet := func(proto, state uint32) *fdinfo.FileEntry {
		return &fdinfo.FileEntry{Type: fdinfo.FdTypes_INETSK.Enum(), Isk: &sk_inet.InetSkEntry{Proto: ptr(proto), State: ptr(state)}}
	}
	reg := &fdinfo.FileEntry{Type: fdinfo.FdTypes_REG.Enum()}
	const established = 1
	for _, c := range []struct {
		name    string
		entries []*fdinfo.FileEntry
		want    bool
	}{
		{"no sockets", []*fdinfo.FileEntry{reg}, false},
		{"listening", []*fdinfo.FileEntry{reg, inet(unix.IPPROTO_TCP, tcpListen)}, false},
		{"closed", []*fdinfo.FileEntry{inet(unix.IPPROTO_TCP, tcpClose)}, false},
		{"udp", []*fdinfo.FileEntry{inet(unix.IPPROTO_UDP, established)}, false},
		{"established", []*fdinfo.FileEntry{inet(unix.IPPROTO_TCP, tcpListen), inet(unix.IPPROTO_TCP, established)}, true},
	} {
		if got := holdsTCPConnections(&criuimg.FilesImage{Entries: c.entries}); got != c.want {
			t.Errorf("%s: %v, want %v", c.name, got, c.want)
		}
	}
}
