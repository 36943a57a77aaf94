package memfile

import (
	"os"
	"path/filepath"

	"github.com/lazyfork/lazyfork/criuimg"
)

// CRIU opens a file for every mapping it restores and keeps it open until its
// restorer maps it (criu/mem.c open_vmas, criu/files-reg.c open_filemap);
// it reuses the open file only for consecutive mappings of one file id with
// the same flags. A process whose converted mappings alternate with
// mappings of other files (or of another memory file) would make the restore
// hold one open file per mapping: about 20,000 fail with "Too many open
// files" under an RLIMIT_NOFILE of 20,000, and 100,000 need as many struct
// files at once.
//
// CRIU has a second path that holds one file at a time: a task whose pages
// image has a parent (an incremental dump) is "premapped": CRIU itself maps
// every private mapping (opening its file, closing it at the next file),
// fills in the pages and hands the areas to the restorer, which mremaps them
// into place (criu/mem.c premap_priv_vmas; pieok is false for a page read
// with a parent, criu/pagemap.c). That is what plain CRIU does for every
// restore of an incremental dump. So a task whose image would need more
// than premapAbove open files gets an empty parent: a directory named
// "parent" (CR_PARENT_LINK, a directory rather than a link) holding a
// pagemap with a head and no entries for that task. No page comes from it;
// only the restore path changes, for that task only.
const (
	premapDir   = "parent"
	premapAbove = 256
)

// vmaOpens counts the files CRIU's open_vmas opens for t's mappings: one per
// change of file id or file flags along its file mappings, in address order.
func vmaOpens(t *task) int {
	if t.mm == nil {
		return 0
	}
	n := 0
	var last struct {
		id, flags uint64
		ok        bool
	}
	for _, v := range t.mm.MM.GetVmas() {
		if v.GetStatus()&vmaAreaRegular == 0 || v.GetStatus()&(vmaFilePrivate|vmaFileShared) == 0 {
			continue
		}
		id, flags := v.GetShmid(), uint64(v.GetFdflags())
		if !last.ok || last.id != id || last.flags != flags {
			n++
		}
		last.id, last.flags, last.ok = id, flags, true
	}
	return n
}

// writePremap gives every task of d in the staged image that would need more than
// premapAbove open files at its restore an empty parent pagemap, so that
// CRIU premaps its mappings (see premapDir). It returns the pids it chose.
//
// Known CRIU 4.1.1 bug on this path: the parent has no pages file, and CRIU
// opens the missing file as an "empty" image whose buffer it never
// initialises, then reads it while reading a child's pages (BUG_ON in
// img_raw_fd): the restored task dies of SIGSEGV when malloc hands back a
// dirty chunk (rare; certain under glibc.malloc.perturb). An empty pages file
// beside the pagemap avoids that but makes a restored child process hang now
// and then (fidelity's TestForkTenPython, 4 runs in 10), so it is not written.
func writePremap(d *dump, staging string) ([]uint32, error) {
	var pids []uint32
	dir := filepath.Join(staging, premapDir)
	for _, t := range d.tasks {
		if t.mm == nil || vmaOpens(t) <= premapAbove {
			continue
		}
		if len(pids) == 0 {
			if err := os.Mkdir(dir, 0o700); err != nil {
				return nil, err
			}
		}
		empty := &criuimg.Pagemap{Head: t.pm.Head, PagesID: t.pm.PagesID, HeadMsg: t.pm.HeadMsg}
		if err := criuimg.WriteImage(criuimg.PagemapPath(dir, t.pid), empty.Image()); err != nil {
			return nil, err
		}
		pids = append(pids, t.pid)
	}
	return pids, nil
}
