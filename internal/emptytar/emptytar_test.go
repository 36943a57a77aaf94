package emptytar

import (
	"archive/tar"
	"bytes"
	"compress/gzip"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"syscall"
	"testing"
	"time"
)

// headers lists the entries of a tar.gz.
func headers(t *testing.T, b []byte) []*tar.Header {
	t.Helper()
	zr, err := gzip.NewReader(bytes.NewReader(b))
	if err != nil {
		t.Fatal(err)
	}
	tr := tar.NewReader(zr)
	var hs []*tar.Header
	for {
		h, err := tr.Next()
		if err == io.EOF {
			return hs
		}
		if err != nil {
			t.Fatal(err)
		}
		hs = append(hs, h)
	}
}

// realTar runs GNU tar as CRIU does, dir on standard input.
func realTar(t *testing.T, dir string) []byte {
	t.Helper()
	tarBin, err := exec.LookPath("tar")
	if err != nil {
		t.Skip("no tar")
	}
	f, err := os.Open(dir)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	cmd := exec.Command(tarBin, criuCreate...)
	cmd.Stdin = f
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("tar: %v", err)
	}
	return out
}

func answer(t *testing.T, dir string) ([]byte, bool) {
	t.Helper()
	f, err := os.Open(dir)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	var out bytes.Buffer
	ok, err := Answer(criuCreate, f, &out)
	if err != nil {
		t.Fatal(err)
	}
	return out.Bytes(), ok
}

// The archive of an empty directory lists what GNU tar's lists: one "./"
// entry with the same type, mode (sticky and set-id bits included), numeric
// owner, no owner names, and modification time.
func TestSameEntryAsGNUTar(t *testing.T) {
	for _, tc := range []struct {
		mode     os.FileMode
		uid, gid int
	}{{0o777 | os.ModeSticky, 0, 0}, {0o755, 0, 0}, {0o700, 1000, 1001}, {0o750 | os.ModeSetgid, 65534, 65534}} {
		dir := filepath.Join(t.TempDir(), "mnt")
		if err := os.Mkdir(dir, 0o700); err != nil {
			t.Fatal(err)
		}
		if err := os.Chmod(dir, tc.mode); err != nil {
			t.Fatal(err)
		}
		if os.Geteuid() == 0 {
			if err := os.Chown(dir, tc.uid, tc.gid); err != nil {
				t.Fatal(err)
			}
		}
		mt := time.Date(2025, 3, 4, 5, 6, 7, 890, time.UTC)
		if err := os.Chtimes(dir, mt, mt); err != nil {
			t.Fatal(err)
		}
		ours, ok := answer(t, dir)
		if !ok {
			t.Fatalf("%s: empty directory not answered", dir)
		}
		want, got := headers(t, realTar(t, dir)), headers(t, ours)
		if len(want) != 1 || len(got) != 1 {
			t.Fatalf("mode %v: %d entries from tar, %d from Answer, want 1 each", tc.mode, len(want), len(got))
		}
		w, g := want[0], got[0]
		if g.Name != w.Name || g.Typeflag != w.Typeflag || g.Mode != w.Mode || g.Uid != w.Uid || g.Gid != w.Gid ||
			g.Uname != w.Uname || g.Gname != w.Gname || !g.ModTime.Equal(w.ModTime) || g.Size != w.Size {
			t.Errorf("mode %v: entry %+v, GNU tar's %+v", tc.mode, g, w)
		}
	}
}

// GNU tar extracts the archive as CRIU's restore does, giving the new
// mount's root the dumped mode, owner and time.
func TestGNUTarExtracts(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root to restore an owner")
	}
	src := filepath.Join(t.TempDir(), "src")
	if err := os.Mkdir(src, 0o700); err != nil {
		t.Fatal(err)
	}
	if err := os.Chmod(src, 0o777|os.ModeSticky); err != nil {
		t.Fatal(err)
	}
	if err := os.Chown(src, 123, 456); err != nil {
		t.Fatal(err)
	}
	mt := time.Date(2024, 1, 2, 3, 4, 5, 0, time.UTC)
	if err := os.Chtimes(src, mt, mt); err != nil {
		t.Fatal(err)
	}
	ours, ok := answer(t, src)
	if !ok {
		t.Fatal("not answered")
	}
	dst := t.TempDir()
	cmd := exec.Command("tar", "--extract", "--gzip", "--no-unquote", "--no-wildcards", "--directory", dst)
	cmd.Stdin = bytes.NewReader(ours)
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("tar --extract: %v: %s", err, out)
	}
	fi, err := os.Stat(dst)
	if err != nil {
		t.Fatal(err)
	}
	if fi.Mode()&os.ModePerm != 0o777 || fi.Mode()&os.ModeSticky == 0 || !fi.ModTime().Equal(mt) {
		t.Errorf("extracted root: mode %v time %v, want drwxrwxrwt %v", fi.Mode(), fi.ModTime(), mt)
	}
	uid, gid := owner(fi)
	if uid != 123 || gid != 456 {
		t.Errorf("extracted root owned by %d:%d, want 123:456", uid, gid)
	}
}

// Anything but CRIU's create of an empty directory is left to tar.
func TestNotAnswered(t *testing.T) {
	dir := t.TempDir()
	f, err := os.Open(dir)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	var out bytes.Buffer
	other := append([]string{}, criuCreate...)
	other[len(other)-1] = "sub"
	for _, args := range [][]string{nil, {"--extract", "--gzip"}, other, criuCreate[:len(criuCreate)-1]} {
		if ok, err := Answer(args, f, &out); ok || err != nil || out.Len() > 0 {
			t.Errorf("args %q: answered %v, %v, %d bytes", args, ok, err, out.Len())
		}
	}
	if err := os.WriteFile(filepath.Join(dir, ".hidden"), nil, 0o600); err != nil {
		t.Fatal(err)
	}
	if ok, err := Answer(criuCreate, f, &out); ok || err != nil || out.Len() > 0 {
		t.Errorf("directory with a file: answered %v, %v, %d bytes", ok, err, out.Len())
	}
	file, err := os.Open(filepath.Join(dir, ".hidden"))
	if err != nil {
		t.Fatal(err)
	}
	defer file.Close()
	if ok, _ := Answer(criuCreate, file, &out); ok || out.Len() > 0 {
		t.Errorf("a regular file on standard input answered")
	}
}

func owner(fi os.FileInfo) (uid, gid int) {
	st := fi.Sys().(*syscall.Stat_t)
	return int(st.Uid), int(st.Gid)
}
