package criuimg

import (
	"path/filepath"
	"regexp"

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
	Name     string         // CRIU's magic name, e.g. "PAGEMAP"
	Magic    uint32         // image magic
	Pattern  *regexp.Regexp // file base names of this kind
	NewEntry NewEntry
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
	{"INVENTORY", MagicInventory, regexp.MustCompile(`^inventory\.img$`), Of(&inventory.InventoryEntry{})},
	{"PSTREE", MagicPstree, regexp.MustCompile(`^pstree\.img$`), Of(&pstree.PstreeEntry{})},
	{"CORE", MagicCore, regexp.MustCompile(`^core-\d+\.img$`), Of(&criucore.CoreEntry{})},
	{"IDS", MagicIDs, regexp.MustCompile(`^ids-\d+\.img$`), Of(&criucore.TaskKobjIdsEntry{})},
	{"MM", MagicMM, regexp.MustCompile(`^mm-\d+\.img$`), Of(&mm.MmEntry{})},
	{"PAGEMAP", MagicPagemap, regexp.MustCompile(`^pagemap-\d+\.img$`), pagemapEntries},
	{"FILES", MagicFiles, regexp.MustCompile(`^files\.img$`), Of(&fdinfo.FileEntry{})},
	{"FDINFO", MagicFdinfo, regexp.MustCompile(`^fdinfo-\d+\.img$`), Of(&fdinfo.FdinfoEntry{})},
	{"FS", MagicFS, regexp.MustCompile(`^fs-\d+\.img$`), Of(&fs.FsEntry{})},
	{"MNTS", MagicMnts, regexp.MustCompile(`^mountpoints-\d+\.img$`), Of(&mnt.MntEntry{})},
	{"SECCOMP", MagicSeccomp, regexp.MustCompile(`^seccomp\.img$`), Of(&seccomp.SeccompEntry{})},
	{"TIMENS", MagicTimens, regexp.MustCompile(`^timens-\d+\.img$`), Of(&timens.TimensEntry{})},
	{"CREDS", MagicCreds, regexp.MustCompile(`^creds-\d+\.img$`), Of(&creds.CredsEntry{})},
	{"TTY_INFO", MagicTTYInfo, regexp.MustCompile(`^tty-info\.img$`), Of(&tty.TtyInfoEntry{})},
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
