package criuimg

import (
	"fmt"
	"os"
	"path/filepath"
	"strconv"

	criucore "github.com/checkpoint-restore/go-criu/v7/crit/images/criu-core"
	"github.com/checkpoint-restore/go-criu/v7/crit/images/fdinfo"
	"github.com/checkpoint-restore/go-criu/v7/crit/images/inventory"
	"github.com/checkpoint-restore/go-criu/v7/crit/images/mm"
	"github.com/checkpoint-restore/go-criu/v7/crit/images/mnt"
	"github.com/checkpoint-restore/go-criu/v7/crit/images/pstree"
	"github.com/containerd/errdefs"
	"google.golang.org/protobuf/proto"
)

// File names inside an image directory.
func InventoryPath(dir string) string      { return filepath.Join(dir, "inventory.img") }
func PstreePath(dir string) string         { return filepath.Join(dir, "pstree.img") }
func FilesPath(dir string) string          { return filepath.Join(dir, "files.img") }
func MMPath(dir string, pid uint32) string { return filepath.Join(dir, "mm-"+itoa(pid)+".img") }
func CorePath(dir string, tid uint32) string {
	return filepath.Join(dir, "core-"+itoa(tid)+".img")
}
func PagemapPath(dir string, pid uint32) string {
	return filepath.Join(dir, "pagemap-"+itoa(pid)+".img")
}
func PagesPath(dir string, id uint32) string {
	return filepath.Join(dir, "pages-"+itoa(id)+".img")
}
func MountpointsPath(dir string, id uint32) string {
	return filepath.Join(dir, "mountpoints-"+itoa(id)+".img")
}

func itoa(v uint32) string { return strconv.FormatUint(uint64(v), 10) }

func single[T proto.Message](path string, magic uint32, zero T) (T, *Image, error) {
	var none T
	img, err := ReadImage(path, magic, Of(zero))
	if err != nil {
		return none, nil, err
	}
	if len(img.Entries) != 1 {
		return none, nil, fmt.Errorf("%s: %d entries, expected 1: %w", path, len(img.Entries), errdefs.ErrDataLoss)
	}
	return img.Entries[0].(T), img, nil
}

func all[T proto.Message](img *Image) []T {
	out := make([]T, len(img.Entries))
	for i, e := range img.Entries {
		out[i] = e.(T)
	}
	return out
}

// ReadInventory reads inventory.img and checks it is a CRIU 4.x image (img_version 2).
func ReadInventory(dir string) (*inventory.InventoryEntry, error) {
	inv, _, err := single(InventoryPath(dir), MagicInventory, &inventory.InventoryEntry{})
	if err != nil {
		return nil, err
	}
	if inv.GetImgVersion() != 2 {
		return nil, fmt.Errorf("%s: image version %d, expected 2: %w", InventoryPath(dir), inv.GetImgVersion(), errdefs.ErrNotImplemented)
	}
	return inv, nil
}

// ReadPstree reads pstree.img: every task, parents before their children.
func ReadPstree(dir string) ([]*pstree.PstreeEntry, error) {
	img, err := ReadImage(PstreePath(dir), MagicPstree, Of(&pstree.PstreeEntry{}))
	if err != nil {
		return nil, err
	}
	if len(img.Entries) == 0 {
		return nil, fmt.Errorf("%s: no tasks: %w", PstreePath(dir), errdefs.ErrDataLoss)
	}
	return all[*pstree.PstreeEntry](img), nil
}

// MMImage is a decoded mm-<pid>.img, kept whole so it re-encodes identically.
type MMImage struct {
	Image *Image
	MM    *mm.MmEntry
}

// ReadMM reads mm-<pid>.img.
func ReadMM(dir string, pid uint32) (*MMImage, error) {
	m, img, err := single(MMPath(dir, pid), MagicMM, &mm.MmEntry{})
	if err != nil {
		return nil, err
	}
	return &MMImage{Image: img, MM: m}, nil
}

// FilesImage is a decoded files.img.
type FilesImage struct {
	Image   *Image
	Entries []*fdinfo.FileEntry
}

// ReadFiles reads files.img.
func ReadFiles(dir string) (*FilesImage, error) {
	img, err := ReadImage(FilesPath(dir), MagicFiles, Of(&fdinfo.FileEntry{}))
	if err != nil {
		return nil, err
	}
	return &FilesImage{Image: img, Entries: all[*fdinfo.FileEntry](img)}, nil
}

// Add appends a file entry.
func (f *FilesImage) Add(e *fdinfo.FileEntry) {
	f.Entries = append(f.Entries, e)
	f.Image.Entries = append(f.Image.Entries, e)
}

// MaxID returns the largest file id in use.
func (f *FilesImage) MaxID() uint32 {
	var m uint32
	for _, e := range f.Entries {
		m = max(m, e.GetId())
	}
	return m
}

// ReadCore reads core-<tid>.img.
func ReadCore(dir string, tid uint32) (*criucore.CoreEntry, error) {
	c, _, err := single(CorePath(dir, tid), MagicCore, &criucore.CoreEntry{})
	return c, err
}

// ReadMounts reads mountpoints-<id>.img.
func ReadMounts(dir string, id uint32) ([]*mnt.MntEntry, error) {
	img, err := ReadImage(MountpointsPath(dir, id), MagicMnts, Of(&mnt.MntEntry{}))
	if err != nil {
		return nil, err
	}
	return all[*mnt.MntEntry](img), nil
}

// Exists reports whether a file exists in dir.
func Exists(path string) bool {
	_, err := os.Stat(path)
	return err == nil
}
