//go:build linux

package node

import (
	"os"
	"strings"
	"testing"
)

// A python counter that moved onto its memory file (lines from a real
// /proc/PID/maps), beside its other mappings.
const sampleMaps = `00400000-00420000 r--p 00000000 00:2a 1712                               /usr/bin/python3.11
00a85000-00aca000 rw-p 00000000 00:29 49                                 /.lazyfork/mem/20261201T154728-a73e75cae25b.mem
20a27000-20e26000 rw-p 10000000000 00:29 49                              /.lazyfork/mem/20261201T154728-a73e75cae25b.mem
7f433c617000-7f433c87d000 rw-p 30000000000 00:29 49                      /.lazyfork/mem/20261201T154728-a73e75cae25b.mem
7f433c8db000-7f433c8dd000 rw-p 40000000000 00:29 52                      /.lazyfork/mem/20261201T154801-0b1c2d3e4f5a.mem (deleted)
7f433c900000-7f433c901000 rw-p 00000000 00:29 60                         /.lazyfork/memory/other.mem
7f433c901000-7f433c902000 rw-p 00000000 00:29 61                         /run/lazyfork/mem/fam/host-path.mem
7f433ca00000-7f433ca21000 rw-p 00000000 00:00 0                          [heap]
7f433cb00000-7f433cb01000 rw-p 00000000 00:00 0
garbage line
zz-10 rw-p 00000000 00:29 49 /.lazyfork/mem/bad-range.mem
`

func TestParseMemFileMaps(t *testing.T) {
	u, err := parseMemFileMaps(strings.NewReader(sampleMaps))
	if err != nil {
		t.Fatal(err)
	}
	want := int64(0xaca000-0xa85000) + (0x20e26000 - 0x20a27000) + (0x7f433c87d000 - 0x7f433c617000) + (0x7f433c8dd000 - 0x7f433c8db000)
	if u.mappings != 4 || u.bytes != want {
		t.Errorf("parsed %d mappings, %d bytes; want 4 mappings, %d bytes", u.mappings, u.bytes, want)
	}
	if u, _ := parseMemFileMaps(strings.NewReader("")); u.mappings != 0 || u.bytes != 0 {
		t.Errorf("empty maps: %+v", u)
	}
}

// The test process itself maps no memory file: a readable maps, no mapping.
func TestProcMemFilesSelf(t *testing.T) {
	u, err := procMemFiles(uint32(os.Getpid()))
	if err != nil || u.mappings != 0 || u.bytes != 0 {
		t.Errorf("own process: %+v, %v", u, err)
	}
	if _, err := procMemFiles(0); err == nil {
		t.Error("pid 0: no error")
	}
}
