//go:build linux

package snapshotter

import (
	"bytes"
	"crypto/sha256"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"testing"

	"github.com/containerd/containerd/v2/core/mount"
	"github.com/containerd/containerd/v2/core/snapshots"
	"github.com/containerd/errdefs"
	"golang.org/x/sys/unix"

	"github.com/lazyfork/lazyfork/internal/testutil"
)

// mountSnapshot mounts key's mounts on a fresh dir, unmounted at cleanup.
func mountSnapshot(t *testing.T, ms []mount.Mount) string {
	t.Helper()
	dir := t.TempDir()
	if err := mount.All(ms, dir); err != nil {
		t.Fatalf("mount %+v: %v", ms, err)
	}
	t.Cleanup(func() {
		if err := mount.UnmountAll(dir, 0); err != nil {
			t.Errorf("unmount %s: %v", dir, err)
		}
	})
	return dir
}

func unmount(t *testing.T, dir string) {
	t.Helper()
	if err := mount.UnmountAll(dir, 0); err != nil {
		t.Fatal(err)
	}
}

// pattern writes n deterministic bytes seeded by seed.
func pattern(seed byte, n int) io.Reader {
	block := make([]byte, 1<<20)
	for i := range block {
		block[i] = byte(i*7) ^ seed
	}
	return io.LimitReader(&repeatReader{b: block}, int64(n))
}

type repeatReader struct {
	b   []byte
	off int
}

func (r *repeatReader) Read(p []byte) (int, error) {
	n := copy(p, r.b[r.off:])
	r.off = (r.off + n) % len(r.b)
	return n, nil
}

func writeFile(t *testing.T, p string, r io.Reader) {
	t.Helper()
	if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
		t.Fatal(err)
	}
	f, err := os.Create(p)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := io.Copy(f, r); err != nil {
		t.Fatal(err)
	}
	if err := f.Close(); err != nil {
		t.Fatal(err)
	}
}

func sum(t *testing.T, p string) [32]byte {
	t.Helper()
	f, err := os.Open(p)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	h := sha256.New()
	if _, err := io.Copy(h, f); err != nil {
		t.Fatal(err)
	}
	var out [32]byte
	copy(out[:], h.Sum(nil))
	return out
}

func sumOf(r io.Reader) [32]byte {
	h := sha256.New()
	io.Copy(h, r)
	var out [32]byte
	copy(out[:], h.Sum(nil))
	return out
}

func exists(p string) bool {
	_, err := os.Lstat(p)
	return err == nil
}

const bigSize = 100 << 20

// parentState writes, into a mounted container rootfs, every kind of change an
// overlay upper can hold: new small and big files, an in-place edit, a deleted
// lower file (whiteout), a replaced lower dir (opaque), hard links, a symlink,
// a sparse file, an xattr, odd owners and modes.
func parentState(t *testing.T, root string) {
	t.Helper()
	writeFile(t, filepath.Join(root, "small.txt"), bytes.NewReader([]byte("small as of the fork")))
	writeFile(t, filepath.Join(root, "big.bin"), pattern(1, bigSize))
	writeFile(t, filepath.Join(root, "etc/keep"), bytes.NewReader([]byte("edited by the parent")))
	must(t, os.Remove(filepath.Join(root, "etc/gone")))
	must(t, os.RemoveAll(filepath.Join(root, "dir")))
	writeFile(t, filepath.Join(root, "dir/new"), bytes.NewReader([]byte("new dir content")))
	must(t, os.Link(filepath.Join(root, "small.txt"), filepath.Join(root, "small.link")))
	must(t, os.Symlink("small.txt", filepath.Join(root, "small.sym")))
	f, err := os.Create(filepath.Join(root, "sparse"))
	must(t, err)
	_, err = f.WriteAt([]byte("end"), 64<<20)
	must(t, err)
	must(t, f.Close())
	must(t, unix.Setxattr(filepath.Join(root, "small.txt"), "user.lazyfork", []byte("xv"), 0))
	writeFile(t, filepath.Join(root, "owned"), bytes.NewReader(nil))
	must(t, os.Lchown(filepath.Join(root, "owned"), 1234, 5678))
	must(t, unix.Chmod(filepath.Join(root, "owned"), 0o4751))
}

func must(t *testing.T, err error) {
	t.Helper()
	if err != nil {
		t.Fatal(err)
	}
}

// checkForkView asserts that root shows the parent as parentState left it.
func checkForkView(t *testing.T, root string, bigSum [32]byte) {
	t.Helper()
	read := func(rel string) string {
		b, err := os.ReadFile(filepath.Join(root, rel))
		if err != nil {
			t.Errorf("%s: %v", rel, err)
		}
		return string(b)
	}
	if got := read("small.txt"); got != "small as of the fork" {
		t.Errorf("small.txt = %q", got)
	}
	if got := read("etc/keep"); got != "edited by the parent" {
		t.Errorf("etc/keep = %q", got)
	}
	if got := read("etc/base"); got != "base" {
		t.Errorf("etc/base = %q", got)
	}
	if exists(filepath.Join(root, "etc/gone")) {
		t.Errorf("etc/gone, deleted by the parent before the fork, is visible")
	}
	if exists(filepath.Join(root, "dir/old")) || read("dir/new") != "new dir content" {
		t.Errorf("dir/ was replaced by the parent; the fork sees the old content or misses the new")
	}
	if sum(t, filepath.Join(root, "big.bin")) != bigSum {
		t.Errorf("big.bin differs from what the parent wrote")
	}
	var a, b unix.Stat_t
	must(t, unix.Lstat(filepath.Join(root, "small.txt"), &a))
	must(t, unix.Lstat(filepath.Join(root, "small.link"), &b))
	if a.Ino != b.Ino || a.Nlink != 2 {
		t.Errorf("hard link lost: inodes %d/%d nlink %d", a.Ino, b.Ino, a.Nlink)
	}
	if l, err := os.Readlink(filepath.Join(root, "small.sym")); err != nil || l != "small.txt" {
		t.Errorf("symlink: %q %v", l, err)
	}
	var sp unix.Stat_t
	must(t, unix.Stat(filepath.Join(root, "sparse"), &sp))
	if sp.Size != 64<<20+3 || sp.Blocks*512 > 1<<20 {
		t.Errorf("sparse file: size %d, %d bytes allocated; want holes kept", sp.Size, sp.Blocks*512)
	}
	v := make([]byte, 16)
	if n, err := unix.Getxattr(filepath.Join(root, "small.txt"), "user.lazyfork", v); err != nil || string(v[:n]) != "xv" {
		t.Errorf("xattr: %q %v", v[:max(n, 0)], err)
	}
	var o unix.Stat_t
	must(t, unix.Lstat(filepath.Join(root, "owned"), &o))
	if o.Uid != 1234 || o.Gid != 5678 || o.Mode&0o7777 != 0o4751 {
		t.Errorf("owned: uid %d gid %d mode %o", o.Uid, o.Gid, o.Mode&0o7777)
	}
}

// TestFreezeForks forks a container's rootfs 10 times at the filesystem
// level and checks what every party sees.
func TestFreezeForks(t *testing.T) {
	testutil.RequiresRoot(t)
	ctx, s := newTestSnapshotter(t)

	// An image layer.
	if _, err := s.Prepare(ctx, "base-extract", ""); err != nil {
		t.Fatal(err)
	}
	baseDir := s.upperPath(mustID(t, s, ctx, "base-extract"))
	for rel, data := range map[string]string{"etc/base": "base", "etc/keep": "keep", "etc/gone": "gone", "dir/old": "old"} {
		writeFile(t, filepath.Join(baseDir, rel), bytes.NewReader([]byte(data)))
	}
	must(t, s.Commit(ctx, "base", "base-extract"))

	// The parent container writes.
	pm, err := s.Prepare(ctx, "parent", "base")
	must(t, err)
	parentRoot := mountSnapshot(t, pm)
	parentState(t, parentRoot)
	bigSum := sumOf(pattern(1, bigSize))

	// Freeze (the caller has frozen the task; here nobody writes meanwhile).
	info, err := s.Freeze(ctx, "parent", "frozen1")
	must(t, err)
	if info.Kind != snapshots.KindCommitted || info.Parent != "base" {
		t.Fatalf("frozen layer: %+v, want committed on base", info)
	}

	// The parent carries on: in-place edits, appends, deletes, new files.
	f, err := os.OpenFile(filepath.Join(parentRoot, "small.txt"), os.O_WRONLY, 0)
	must(t, err)
	_, err = f.WriteAt([]byte("SMALL"), 0)
	must(t, err)
	must(t, f.Close())
	f, err = os.OpenFile(filepath.Join(parentRoot, "big.bin"), os.O_WRONLY, 0)
	must(t, err)
	_, err = f.WriteAt([]byte("parent was here"), bigSize/2)
	must(t, err)
	must(t, f.Close())
	must(t, os.Remove(filepath.Join(parentRoot, "etc/keep")))
	writeFile(t, filepath.Join(parentRoot, "after"), bytes.NewReader([]byte("after the fork")))

	const forks = 10
	roots := make([]string, forks)
	for i := range forks {
		m, err := s.Prepare(ctx, fmt.Sprintf("fork-%d", i), "frozen1")
		must(t, err)
		roots[i] = mountSnapshot(t, m)
	}
	for i, r := range roots {
		t.Run(fmt.Sprintf("fork-%d-sees-fork-instant", i), func(t *testing.T) {
			checkForkView(t, r, bigSum)
			if exists(filepath.Join(r, "after")) {
				t.Error("a file the parent made after the fork is visible")
			}
		})
	}

	// Each fork writes and deletes; nobody else sees it.
	for i, r := range roots {
		writeFile(t, filepath.Join(r, fmt.Sprintf("fork-%d", i)), bytes.NewReader([]byte("mine")))
		must(t, os.Remove(filepath.Join(r, "etc/base")))
		f, err := os.OpenFile(filepath.Join(r, "big.bin"), os.O_WRONLY, 0)
		must(t, err)
		_, err = f.WriteAt([]byte(fmt.Sprintf("fork %d", i)), 0)
		must(t, err)
		must(t, f.Close())
	}
	for i, r := range roots {
		for j := range forks {
			if exists(filepath.Join(r, fmt.Sprintf("fork-%d", j))) != (i == j) {
				t.Errorf("fork %d: visibility of fork-%d's file is wrong", i, j)
			}
		}
		head := make([]byte, 6)
		g, err := os.Open(filepath.Join(r, "big.bin"))
		must(t, err)
		_, err = g.ReadAt(head, 0)
		must(t, err)
		g.Close()
		if string(head) != fmt.Sprintf("fork %d", i) {
			t.Errorf("fork %d reads %q at big.bin's start", i, head)
		}
	}
	if exists(filepath.Join(parentRoot, "fork-0")) || !exists(filepath.Join(parentRoot, "etc/base")) {
		t.Error("a fork's write or delete reached the parent")
	}
	if b, _ := os.ReadFile(filepath.Join(parentRoot, "small.txt")); string(b) != "SMALL as of the fork" {
		t.Errorf("parent's own small.txt = %q", b)
	}

	// A fork of a fork stacks one more frozen layer.
	_, err = s.Freeze(ctx, "fork-0", "frozen2")
	must(t, err)
	ffm, err := s.Prepare(ctx, "fork-of-fork", "frozen2")
	must(t, err)
	ff := mountSnapshot(t, ffm)
	if !exists(filepath.Join(ff, "fork-0")) || exists(filepath.Join(ff, "etc/base")) || exists(filepath.Join(ff, "fork-1")) {
		t.Error("fork of fork 0 does not see exactly fork 0's changes")
	}
	if b, _ := os.ReadFile(filepath.Join(ff, "small.txt")); string(b) != "small as of the fork" {
		t.Errorf("fork of fork reads small.txt = %q, want the first frozen layer's", b)
	}
	if fi, err := s.Stat(ctx, "frozen2"); err != nil || fi.Parent != "frozen1" {
		t.Errorf("frozen2: %+v %v, want parent frozen1", fi, err)
	}

	// Lifetime: a frozen layer goes exactly when its last user goes.
	frozen1Dir := filepath.Dir(s.upperPath(mustID(t, s, ctx, "frozen1")))
	unmount(t, parentRoot)
	must(t, s.Remove(ctx, "parent")) // the parent does not hold the frozen layer
	for i := 1; i < forks; i++ {
		unmount(t, roots[i])
		must(t, s.Remove(ctx, fmt.Sprintf("fork-%d", i)))
	}
	for _, key := range []string{"frozen1", "frozen2"} {
		if err := s.Remove(ctx, key); !errors.Is(err, errdefs.ErrFailedPrecondition) {
			t.Errorf("remove %s while used: %v, want failed precondition", key, err)
		}
	}
	unmount(t, ff)
	must(t, s.Remove(ctx, "fork-of-fork"))
	must(t, s.Remove(ctx, "frozen2"))
	unmount(t, roots[0])
	must(t, s.Remove(ctx, "fork-0"))
	if !exists(frozen1Dir) {
		t.Fatal("frozen1 vanished while unused but not yet removed")
	}
	must(t, s.Remove(ctx, "frozen1"))
	if exists(frozen1Dir) {
		t.Error("frozen1's directory outlived its record")
	}
	assertNoStrayDirs(t, s)
	st, err := s.Status(ctx)
	must(t, err)
	if st.Frozen != 0 || st.Active != 0 || st.Committed != 1 {
		t.Errorf("status at the end: %+v", st)
	}
}
