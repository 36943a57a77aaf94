package criuimg

import (
	"path/filepath"
	"strings"

	"github.com/checkpoint-restore/go-criu/v7/crit/images/creds"
	criucore "github.com/checkpoint-restore/go-criu/v7/crit/images/criu-core"
	"github.com/checkpoint-restore/go-criu/v7/crit/images/fdinfo"
	"github.com/checkpoint-restore/go-criu/v7/crit/images/fs"
	"github.com/checkpoint-restore/go-criu/v7/crit/images/inventory"
	"github.com/checkpoint-restore/go-criu/v7/crit/images/mm"
	"github.com/checkpoint-restore/go-criu/v7/crit/images/mnt"
	"github.com/checkpoint-restore/go-criu/v7/crit/images/pagemap"
	"github.com/checkpoint-restore/go-criu/v7/crit/images/pstree"
	"github.com/checkpoint-restore/go-criu/v7/crit/images/seccomp"
	"github.com/checkpoint-restore/go-criu/v7/crit/images/timens"
	"github.com/checkpoint-restore/go-criu/v7/crit/images/tty"
	"google.golang.org/protobuf/proto"
)

// Kind describes one kind of image file this package knows.
type Kind struct {
	Name     string      // CRIU's magic name, e.g. "PAGEMAP"
	Magic    uint32      // image magic
	Pattern  NamePattern // file base names of this kind
	NewEntry NewEntry
}

// NamePattern matches the file names of one kind of image: PREFIX.img, or
// PREFIX-ID.img with a decimal id (a task's or an object's).
type NamePattern struct {
	Prefix string
	PerID  bool
}

// MatchString reports whether base is such a name.
func (p NamePattern) MatchString(base string) bool {
	rest, ok := strings.CutPrefix(base, p.Prefix)
	if !ok {
		return false
	}
	rest, ok = strings.CutSuffix(rest, ".img")
	if !ok {
		return false
	}
	if !p.PerID {
		return rest == ""
	}
	id, ok := strings.CutPrefix(rest, "-")
	if !ok || id == "" {
		return false
	}
	for i := 0; i < len(id); i++ {
		if id[i] < '0' || id[i] > '9' {
			return false
		}
	}
	return true
}

// pagemapEntries gives the head type to entry 0 and pagemap_entry to the rest.
func pagemapEntries(i int) proto.Message {
	if i == 0 {
		return &pagemap.PagemapHead{}
	}
	return &pagemap.PagemapEntry{}
}

// Kinds lists the image files criuimg can decode and re-encode byte for byte.
//
// stats-dump and stats-restore are left out on purpose: go-criu v7 carries
// two generated copies of stats.proto (crit/images/stats and stats), which
// register the same name, and a binary that links both panics at start-up.
// Read stats with github.com/checkpoint-restore/go-criu/v7/stats.
var Kinds = []Kind{
	{"INVENTORY", MagicInventory, NamePattern{Prefix: "inventory"}, Of(&inventory.InventoryEntry{})},
	{"PSTREE", MagicPstree, NamePattern{Prefix: "pstree"}, Of(&pstree.PstreeEntry{})},
	{"CORE", MagicCore, NamePattern{Prefix: "core", PerID: true}, Of(&criucore.CoreEntry{})},
	{"IDS", MagicIDs, NamePattern{Prefix: "ids", PerID: true}, Of(&criucore.TaskKobjIdsEntry{})},
	{"MM", MagicMM, NamePattern{Prefix: "mm", PerID: true}, Of(&mm.MmEntry{})},
	{"PAGEMAP", MagicPagemap, NamePattern{Prefix: "pagemap", PerID: true}, pagemapEntries},
	{"FILES", MagicFiles, NamePattern{Prefix: "files"}, Of(&fdinfo.FileEntry{})},
	{"FDINFO", MagicFdinfo, NamePattern{Prefix: "fdinfo", PerID: true}, Of(&fdinfo.FdinfoEntry{})},
	{"FS", MagicFS, NamePattern{Prefix: "fs", PerID: true}, Of(&fs.FsEntry{})},
	{"MNTS", MagicMnts, NamePattern{Prefix: "mountpoints", PerID: true}, Of(&mnt.MntEntry{})},
	{"SECCOMP", MagicSeccomp, NamePattern{Prefix: "seccomp"}, Of(&seccomp.SeccompEntry{})},
	{"TIMENS", MagicTimens, NamePattern{Prefix: "timens", PerID: true}, Of(&timens.TimensEntry{})},
	{"CREDS", MagicCreds, NamePattern{Prefix: "creds", PerID: true}, Of(&creds.CredsEntry{})},
	{"TTY_INFO", MagicTTYInfo, NamePattern{Prefix: "tty-info"}, Of(&tty.TtyInfoEntry{})},
}

// KindOf returns the Kind of an image file by its name, or nil.
func KindOf(path string) *Kind {
	base := filepath.Base(path)
	for i := range Kinds {
		if Kinds[i].Pattern.MatchString(base) {
			return &Kinds[i]
		}
	}
	return nil
}
