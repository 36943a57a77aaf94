//go:build linux

package snapshotter

import (
	"bytes"
	"crypto/sha256"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/containerd/containerd/v2/core/snapshots"
	"golang.org/x/sys/unix"

	"github.com/lazyfork/lazyfork/snapshotter/client"
)

// treeState describes a layer for comparison: type, mode, owner, size,
// content or link target of every entry.
func treeState(t *testing.T, root string) map[string]string {
	t.Helper()
	out := map[string]string{}
	err := filepath.WalkDir(root, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		rel, _ := filepath.Rel(root, p)
		var st unix.Stat_t
		if err := unix.Lstat(p, &st); err != nil {
			return err
		}
		desc := fmt.Sprintf("mode=%o uid=%d gid=%d", st.Mode, st.Uid, st.Gid)
		switch st.Mode & unix.S_IFMT {
		case unix.S_IFREG:
			b, err := os.ReadFile(p)
			if err != nil {
				return err
			}
			if len(b) > 64 {
				desc += fmt.Sprintf(" nlink=%d sha256=%x", st.Nlink, sha256.Sum256(b))
			} else {
				desc += fmt.Sprintf(" nlink=%d data=%q", st.Nlink, b)
			}
		case unix.S_IFLNK:
			l, _ := os.Readlink(p)
			desc += " -> " + l
		}
		out[rel] = desc
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	return out
}

func diffStates(t *testing.T, got, want map[string]string) {
	t.Helper()
	for k, w := range want {
		if g, ok := got[k]; !ok {
			t.Errorf("frozen layer misses %s (%s)", k, w)
		} else if g != w {
			t.Errorf("%s: frozen %s, source %s", k, g, w)
		}
	}
	for k, g := range got {
		if _, ok := want[k]; !ok {
			t.Errorf("frozen layer has %s (%s) that the source no longer has", k, g)
		}
	}
}

// The first pass copies while the task runs; everything the task changes
// before the freeze must be in the frozen layer, including writes made in
// the same clock tick as the copy and writes through a shared mapping.
func TestTwoPassFreeze(t *testing.T) {
	ctx, s := newTestSnapshotter(t)
	if _, err := s.Prepare(ctx, "img-x", ""); err != nil {
		t.Fatal(err)
	}
	must(t, s.Commit(ctx, "img", "img-x"))
	if _, err := s.Prepare(ctx, "ctr", "img"); err != nil {
		t.Fatal(err)
	}
	up := s.upperPath(mustID(t, s, ctx, "ctr"))
	files := map[string]string{"same": "unchanged", "edit": "before", "gone": "x", "mv-a": "moved",
		"mode": "m", "d/deep": "deep", "link": "linked", "mapped": string(bytes.Repeat([]byte("a"), 8192))}
	for rel, data := range files {
		writeFile(t, filepath.Join(up, rel), bytes.NewReader([]byte(data)))
	}
	// A mapping made before the first pass, written after it.
	mf, err := os.OpenFile(filepath.Join(up, "mapped"), os.O_RDWR, 0)
	must(t, err)
	defer mf.Close()
	mem, err := unix.Mmap(int(mf.Fd()), 0, 8192, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
	must(t, err)
	defer unix.Munmap(mem)
	copy(mem[4096:], "dirty before the first pass")
	// Let the clock tick past these changes, so that only what pass 1's
	// fsync does can tell the later write through the mapping apart.
	time.Sleep(50 * time.Millisecond)

	// Pass 1 (task running).
	if _, err := s.Prepare(ctx, "frz-tmp", "img", snapshots.WithLabels(map[string]string{FreezeSourceLabel: "ctr"})); err != nil {
		t.Fatal(err)
	}
	inoOf := func(p string) uint64 {
		var st unix.Stat_t
		must(t, unix.Stat(p, &st))
		return st.Ino
	}
	tmpUpper := s.upperPath(mustID(t, s, ctx, "frz-tmp"))
	sameIno, editIno := inoOf(filepath.Join(tmpUpper, "same")), inoOf(filepath.Join(tmpUpper, "edit"))
	// The task changes things, at once (same clock tick) and in every way.
	f, err := os.OpenFile(filepath.Join(up, "edit"), os.O_WRONLY, 0)
	must(t, err)
	_, err = f.WriteAt([]byte("AFTER!"), 0) // same size as before
	must(t, err)
	f.Close()
	copy(mem[4096:], "written through the mapping") // page made clean by pass 1's fsync
	must(t, os.Remove(filepath.Join(up, "gone")))
	must(t, os.Rename(filepath.Join(up, "mv-a"), filepath.Join(up, "mv-b")))
	must(t, unix.Chmod(filepath.Join(up, "mode"), 0o600))
	must(t, os.Link(filepath.Join(up, "link"), filepath.Join(up, "link2")))
	must(t, os.RemoveAll(filepath.Join(up, "d")))
	must(t, os.Mkdir(filepath.Join(up, "d"), 0o700))
	writeFile(t, filepath.Join(up, "new"), bytes.NewReader([]byte("new")))
	must(t, os.Symlink("new", filepath.Join(up, "sym")))

	// Pass 2 (task frozen).
	must(t, s.Commit(ctx, "frozen", "frz-tmp", snapshots.WithLabels(map[string]string{client.FrozenFromLabel: "ctr"})))
	want := treeState(t, up)
	frozen := s.upperPath(mustID(t, s, ctx, "frozen"))
	diffStates(t, treeState(t, frozen), want)
	if exists(filepath.Join(filepath.Dir(frozen), freezeProbe)) || exists(filepath.Join(filepath.Dir(frozen), syncDirName)) {
		t.Error("freeze bookkeeping left in the snapshot dir")
	}
	// Unchanged files come from the first pass (same inode), changed ones
	// were copied again.
	if inoOf(filepath.Join(frozen, "same")) != sameIno {
		t.Error("an unchanged file was copied twice")
	}
	if inoOf(filepath.Join(frozen, "edit")) == editIno {
		t.Error("a changed file was taken from the first pass")
	}
	// The first pass's tree is gone: the frozen layer holds them once.
	var st unix.Stat_t
	must(t, unix.Stat(filepath.Join(frozen, "same"), &st))
	if st.Nlink != 1 {
		t.Errorf("same: nlink %d", st.Nlink)
	}
	assertNoStrayDirs(t, s)
}

// A crash in the first pass, just before its copy replaced the empty layer,
// leaves the freeze's snapshot with an empty layer, the probe and fs.pre.
// The next start removes fs.pre, and the Commit copies everything.
func TestFreezeAfterCrashInFirstPass(t *testing.T) {
	ctx, s := newTestSnapshotter(t)
	files := freezeSetup(t, ctx, s, "ctr")
	if _, err := s.Prepare(ctx, "frz-tmp", "base", snapshots.WithLabels(map[string]string{FreezeSourceLabel: "ctr"})); err != nil {
		t.Fatal(err)
	}
	dir := filepath.Dir(s.upperPath(mustID(t, s, ctx, "frz-tmp")))
	must(t, os.Rename(filepath.Join(dir, "fs"), filepath.Join(dir, preDirName)))
	must(t, os.Mkdir(filepath.Join(dir, "fs"), 0o755))
	root := s.Root()
	must(t, s.Close())

	s, err := New(ctx, root)
	must(t, err)
	t.Cleanup(func() { s.Close() })
	if exists(filepath.Join(dir, preDirName)) {
		t.Errorf("the start left the first pass's partial copy %s", filepath.Join(dir, preDirName))
	}
	must(t, s.Commit(ctx, "frozen", "frz-tmp"))
	checkFrozen(t, ctx, s, "frozen", files)
	assertNoStrayDirs(t, s)
}
