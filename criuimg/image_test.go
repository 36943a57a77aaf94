package criuimg_test

import (
	"bytes"
	"encoding/binary"
	"errors"
	"strings"
	"testing"

	"github.com/checkpoint-restore/go-criu/v7/crit/images/pagemap"
	"github.com/checkpoint-restore/go-criu/v7/crit/images/pstree"
	"github.com/containerd/errdefs"
	"github.com/lazyfork/lazyfork/criuimg"
	"google.golang.org/protobuf/proto"
)

func sample(t *testing.T) []byte {
	img := &criuimg.Image{Head: criuimg.MagicCommon, Magic: criuimg.MagicPstree}
	img.Entries = append(img.Entries,
		&pstree.PstreeEntry{Pid: proto.Uint32(1), Ppid: proto.Uint32(0), Pgid: proto.Uint32(1), Sid: proto.Uint32(1), Threads: []uint32{1, 2}},
		&pstree.PstreeEntry{Pid: proto.Uint32(3), Ppid: proto.Uint32(1), Pgid: proto.Uint32(1), Sid: proto.Uint32(1), Threads: []uint32{3}})
	b, err := img.Bytes()
	if err != nil {
		t.Fatal(err)
	}
	return b
}

func TestDecodeEncode(t *testing.T) {
	b := sample(t)
	img, err := criuimg.Decode(bytes.NewReader(b), criuimg.MagicPstree, criuimg.Of(&pstree.PstreeEntry{}))
	if err != nil {
		t.Fatal(err)
	}
	if img.Head != criuimg.MagicCommon || len(img.Entries) != 2 {
		t.Fatalf("decoded %+v", img)
	}
	again, _ := img.Bytes()
	if !bytes.Equal(b, again) {
		t.Fatal("round trip differs")
	}
}

func TestDecodeErrors(t *testing.T) {
	b := sample(t)
	newE := criuimg.Of(&pstree.PstreeEntry{})
	// Every truncation point is an error, except the end of a whole entry.
	ends := map[int]bool{}
	off := 8
	for off < len(b) {
		off += 4 + int(binary.LittleEndian.Uint32(b[off:]))
		ends[off] = true
	}
	for n := 0; n < len(b); n++ {
		_, err := criuimg.Decode(bytes.NewReader(b[:n]), criuimg.MagicPstree, newE)
		if ends[n] {
			if err != nil {
				t.Errorf("cut at entry boundary %d: %v", n, err)
			}
			continue
		}
		if n == 8 {
			continue // magic only: an empty image
		}
		if err == nil || !errors.Is(err, errdefs.ErrDataLoss) {
			t.Errorf("cut at %d: want data-loss error, got %v", n, err)
		}
	}
	if _, err := criuimg.Decode(bytes.NewReader(b), criuimg.MagicMM, newE); err == nil || !strings.Contains(err.Error(), "bad magic") {
		t.Errorf("wrong magic: %v", err)
	}
	bad := append([]byte(nil), b...)
	binary.LittleEndian.PutUint32(bad[8:], 1<<30)
	if _, err := criuimg.Decode(bytes.NewReader(bad), criuimg.MagicPstree, newE); !errors.Is(err, errdefs.ErrDataLoss) {
		t.Errorf("huge length: %v", err)
	}
	garbage := append([]byte(nil), b[:12]...)
	garbage = append(garbage, bytes.Repeat([]byte{0xff}, int(binary.LittleEndian.Uint32(b[8:])))...)
	if _, err := criuimg.Decode(bytes.NewReader(garbage), criuimg.MagicPstree, newE); !errors.Is(err, errdefs.ErrDataLoss) {
		t.Errorf("garbage payload: %v", err)
	}
}

func TestPagemapIndex(t *testing.T) {
	pm := &criuimg.Pagemap{}
	pm.Entries = append(pm.Entries,
		criuimg.NewPresentEntry(0x10000, 2),
		&pagemap.PagemapEntry{Vaddr: proto.Uint64(0x20000), NrPages: proto.Uint32(4), Flags: proto.Uint32(criuimg.PEParent)},
		criuimg.NewPresentEntry(0x30000, 3))
	ix := pm.Index()
	for _, c := range []struct {
		va  uint64
		off int64
		run uint64
	}{
		{0x10000, 0, 2}, {0x11000, 4096, 1}, {0x12000, 0, 0}, {0x20000, 0, 0},
		{0x30000, 8192, 3}, {0x32000, 16384, 1}, {0x33000, 0, 0}, {0x1000, 0, 0},
	} {
		off, run := ix.Lookup(c.va)
		if off != c.off || run != c.run {
			t.Errorf("Lookup(%#x) = %d, %d; want %d, %d", c.va, off, run, c.off, c.run)
		}
	}
}
