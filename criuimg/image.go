package criuimg

import (
	"bufio"
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"os"

	"github.com/containerd/errdefs"
	"google.golang.org/protobuf/proto"
)

// Head magics (criu/include/magic.h).
const (
	MagicCommon  uint32 = 0x54564319 // IMG_COMMON_MAGIC: regular images
	MagicService uint32 = 0x55105940 // IMG_SERVICE_MAGIC: stats, irmap cache
)

// Image magics of the files LazyFork touches (criu/include/magic.h).
const (
	MagicInventory uint32 = 0x58313116
	MagicPstree    uint32 = 0x50273030
	MagicCore      uint32 = 0x55053847
	MagicIDs       uint32 = 0x54432030
	MagicMM        uint32 = 0x57492820
	MagicPagemap   uint32 = 0x56084025
	MagicFiles     uint32 = 0x56303138
	MagicFdinfo    uint32 = 0x56213732
	MagicFS        uint32 = 0x51403912
	MagicMnts      uint32 = 0x55563928
	MagicStats     uint32 = 0x57093306
	MagicSeccomp   uint32 = 0x64413049
	MagicTimens    uint32 = 0x43114433
	MagicCreds     uint32 = 0x54023547
	MagicTTYInfo   uint32 = 0x59453036
)

// maxEntry bounds one payload so a corrupt length cannot make us allocate
// gigabytes. The largest real entries (core with xsave, mm with thousands of
// VMAs) are well below it.
const maxEntry = 64 << 20

// Image is one decoded image file.
type Image struct {
	// Head is MagicCommon, MagicService, or 0 when the file has no head magic
	// (inventory in CRIU 4.x has one; raw images have none and are not Images).
	Head uint32
	// Magic is the image's own magic.
	Magic uint32
	// Entries are the decoded payloads, in file order.
	Entries []proto.Message
}

// NewEntry returns an empty message for the i-th entry of an image.
type NewEntry func(i int) proto.Message

// Of returns a NewEntry that gives every entry the type of m.
func Of[T proto.Message](m T) NewEntry {
	return func(int) proto.Message { return m.ProtoReflect().New().Interface() }
}

// Decode reads an image whose magic must be want (0 accepts any).
// Truncation, a bad magic or an undecodable payload is an error.
func Decode(r io.Reader, want uint32, newEntry NewEntry) (*Image, error) {
	br := bufio.NewReaderSize(r, 64<<10)
	var word [4]byte
	if _, err := io.ReadFull(br, word[:]); err != nil {
		return nil, truncated("magic", err)
	}
	img := &Image{Magic: binary.LittleEndian.Uint32(word[:])}
	if img.Magic == MagicCommon || img.Magic == MagicService {
		img.Head = img.Magic
		if _, err := io.ReadFull(br, word[:]); err != nil {
			return nil, truncated("magic", err)
		}
		img.Magic = binary.LittleEndian.Uint32(word[:])
	}
	if want != 0 && img.Magic != want {
		return nil, fmt.Errorf("bad magic %#x, expected %#x: %w", img.Magic, want, errdefs.ErrInvalidArgument)
	}
	var buf []byte
	for i := 0; ; i++ {
		n, err := io.ReadFull(br, word[:])
		if err == io.EOF {
			return img, nil
		}
		if err != nil {
			return nil, truncated(fmt.Sprintf("length of entry %d", i), err)
		}
		size := binary.LittleEndian.Uint32(word[:n])
		if size > maxEntry {
			return nil, fmt.Errorf("entry %d: length %d too large: %w", i, size, errdefs.ErrDataLoss)
		}
		if cap(buf) < int(size) {
			buf = make([]byte, size)
		}
		buf = buf[:size]
		if _, err := io.ReadFull(br, buf); err != nil {
			return nil, truncated(fmt.Sprintf("entry %d (%d bytes)", i, size), err)
		}
		m := newEntry(i)
		if err := proto.Unmarshal(buf, m); err != nil {
			return nil, fmt.Errorf("entry %d: %v: %w", i, err, errdefs.ErrDataLoss)
		}
		img.Entries = append(img.Entries, m)
	}
}

func truncated(what string, err error) error {
	if errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF) {
		return fmt.Errorf("truncated image: short %s: %w", what, errdefs.ErrDataLoss)
	}
	return fmt.Errorf("reading %s: %w", what, err)
}

// Encode writes img in CRIU's framing.
func (img *Image) Encode(w io.Writer) error {
	var out bytes.Buffer
	if img.Head != 0 {
		out.Write(binary.LittleEndian.AppendUint32(nil, img.Head))
	}
	out.Write(binary.LittleEndian.AppendUint32(nil, img.Magic))
	opts := proto.MarshalOptions{}
	var payload []byte
	for i, m := range img.Entries {
		var err error
		payload, err = opts.MarshalAppend(payload[:0], m)
		if err != nil {
			return fmt.Errorf("encoding entry %d: %w", i, err)
		}
		out.Write(binary.LittleEndian.AppendUint32(nil, uint32(len(payload))))
		out.Write(payload)
	}
	_, err := w.Write(out.Bytes())
	return err
}

// Bytes returns the encoded image.
func (img *Image) Bytes() ([]byte, error) {
	var b bytes.Buffer
	if err := img.Encode(&b); err != nil {
		return nil, err
	}
	return b.Bytes(), nil
}

// ReadImage decodes the image file at path. A missing file is
// errdefs.ErrNotFound; every error names the file.
func ReadImage(path string, want uint32, newEntry NewEntry) (*Image, error) {
	f, err := os.Open(path)
	if err != nil {
		if errors.Is(err, os.ErrNotExist) {
			return nil, fmt.Errorf("%s: %w", path, errdefs.ErrNotFound)
		}
		return nil, err
	}
	defer f.Close()
	img, err := Decode(f, want, newEntry)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", path, err)
	}
	return img, nil
}

// WriteImage writes img to path (created or truncated, mode 0644 like CRIU).
// Callers that need atomicity write into a staging directory.
func WriteImage(path string, img *Image) error {
	b, err := img.Bytes()
	if err != nil {
		return fmt.Errorf("%s: %w", path, err)
	}
	return os.WriteFile(path, b, 0o644)
}
