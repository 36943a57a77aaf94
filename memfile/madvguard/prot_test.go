package madvguard

import (
	"os"
	"testing"
	"unsafe"

	"golang.org/x/sys/unix"
)

func TestProtOf(t *testing.T) {
	const page = 4096
	b, err := unix.Mmap(-1, 0, 4*page, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS)
	if err != nil {
		t.Fatal(err)
	}
	base := uint64(uintptr(unsafe.Pointer(&b[0])))
	defer unix.Syscall(unix.SYS_MUNMAP, uintptr(base), 3*page, 0)
	if err := unix.Mprotect(b[2*page:3*page], unix.PROT_READ); err != nil {
		t.Fatal(err)
	}
	if _, _, e := unix.Syscall(unix.SYS_MUNMAP, uintptr(base+3*page), page, 0); e != 0 { // a hole after the range
		t.Fatal(e)
	}
	tr := &tracer{maps: map[int]*os.File{}}
	defer tr.closeMaps()
	pid := os.Getpid()
	for _, c := range []struct {
		name       string
		start, end uint64
		prot       int
		ok         bool
	}{
		{"rw pages", base, base + 2*page, unix.PROT_READ | unix.PROT_WRITE, true},
		{"read-only page", base + 2*page, base + 3*page, unix.PROT_READ, true},
		{"mixed protection", base + page, base + 3*page, 0, false},
		{"into a hole", base + 2*page, base + 4*page, 0, false},
	} {
		for name, fn := range map[string]func(int, uint64, uint64) (int, bool){
			"PROCMAP_QUERY": tr.protOf, "maps text": protFromMaps,
		} {
			prot, ok := fn(pid, c.start, c.end)
			if ok != c.ok || (ok && prot != c.prot) {
				t.Errorf("%s, %s: prot %#x ok %v, want %#x %v", c.name, name, prot, ok, c.prot, c.ok)
			}
		}
	}
}
