package criuproxy

import (
	"archive/tar"
	"bytes"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"
)

// criuCreate is the argument list CRIU 4.1 runs tar with to dump a tmpfs
// mount (criu/filesystems.c, tmpfs_dump), the mount's root directory on
// standard input.
var criuCreate = []string{"--create", "--gzip", "--no-unquote", "--no-wildcards",
	"--one-file-system", "--check-links", "--preserve-permissions", "--sparse",
	"--numeric-owner", "--directory", "/proc/self/fd/0", "."}

// untar lists the entries of a tar.gz and returns the first 512 bytes of the
// tar (the first entry's header).
func untar(t *testing.T, b []byte) ([]*tar.Header, []byte) {
	t.Helper()
	raw := gunzip(t, b)
	if len(raw) < 512 {
		t.Fatalf("a tar of %d bytes", len(raw))
	}
	tr := tar.NewReader(bytes.NewReader(raw))
	var hs []*tar.Header
	for {
		h, err := tr.Next()
		if err == io.EOF {
			return hs, raw[:512]
		}
		if err != nil {
			t.Fatal(err)
		}
		hs = append(hs, h)
	}
}

// runTar runs bin with args and stdin open on path, env added; it must
// succeed.
func runTar(t *testing.T, bin string, env []string, path string, args ...string) []byte {
	t.Helper()
	f, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	cmd := exec.Command(bin, args...)
	cmd.Env = append(os.Environ(), env...)
	cmd.Stdin = f
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("%s %q: %v: %s", bin, args, err, stderr.Bytes())
	}
	return out
}

// gnuTar is GNU tar, as the proxy's tar runs it for what it does not answer.
func gnuTar(t *testing.T) string {
	t.Helper()
	p, err := exec.LookPath("tar")
	if err != nil {
		t.Skip("no tar")
	}
	if out, _ := exec.Command(p, "--version").Output(); !bytes.Contains(out, []byte("GNU tar")) {
		t.Skipf("%s is no GNU tar", p)
	}
	return p
}

// TestTarSameEntryAsGNUTar: the proxy's archive of an empty directory holds
// what GNU tar's does: one "./" entry with the same header, byte for byte
// (type, mode with sticky and set-id bits, numeric owner, no owner names,
// modification time, checksum), and nothing else.
func TestTarSameEntryAsGNUTar(t *testing.T) {
	_, proxyTar, _ := proxy(t)
	real := gnuTar(t)
	for _, tc := range []struct {
		mode     os.FileMode
		uid, gid int
	}{{0o777 | os.ModeSticky, 0, 0}, {0o755, 0, 0}, {0o700, 1000, 1001}, {0o750 | os.ModeSetgid, 65534, 65534},
		{0o711 | os.ModeSetuid, 123456, 7}} {
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
		// LAZYFORK_TAR_REAL is a tar that fails: the proxy must answer.
		ours := runTar(t, proxyTar, []string{EnvTarReal + "=/bin/false"}, dir, criuCreate...)
		want, wantHdr := untar(t, runTar(t, real, nil, dir, criuCreate...))
		got, gotHdr := untar(t, ours)
		if len(want) != 1 || len(got) != 1 {
			t.Fatalf("mode %v: %d entries from tar, %d from the proxy, want 1 each", tc.mode, len(want), len(got))
		}
		w, g := want[0], got[0]
		if g.Name != w.Name || g.Typeflag != w.Typeflag || g.Mode != w.Mode || g.Uid != w.Uid || g.Gid != w.Gid ||
			g.Uname != w.Uname || g.Gname != w.Gname || !g.ModTime.Equal(w.ModTime) || g.Size != w.Size || g.Format != w.Format {
			t.Errorf("mode %v: entry %+v, GNU tar's %+v", tc.mode, g, w)
		}
		if !bytes.Equal(gotHdr, wantHdr) {
			t.Errorf("mode %v: header\n% x\nGNU tar's\n% x", tc.mode, gotHdr, wantHdr)
		}
	}
}

// TestTarGNUTarExtracts: GNU tar extracts the proxy's archive as CRIU's
// restore does, giving the new mount's root the dumped mode, owner and time.
func TestTarGNUTarExtracts(t *testing.T) {
	_, proxyTar, _ := proxy(t)
	real := gnuTar(t)
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
	ours := runTar(t, proxyTar, []string{EnvTarReal + "=/bin/false"}, src, criuCreate...)
	dst := t.TempDir()
	// CRIU's restore arguments (criu/filesystems.c, tmpfs_restore).
	cmd := exec.Command(real, "--extract", "--gzip", "--no-unquote", "--no-wildcards", "--directory", dst)
	cmd.Stdin = bytes.NewReader(ours)
	if out, err := cmd.CombinedOutput(); err != nil || len(out) > 0 {
		t.Fatalf("tar --extract: %v: %s", err, out)
	}
	fi, err := os.Stat(dst)
	if err != nil {
		t.Fatal(err)
	}
	if fi.Mode()&os.ModePerm != 0o777 || fi.Mode()&os.ModeSticky == 0 || !fi.ModTime().Equal(mt) {
		t.Errorf("extracted root: mode %v time %v, want drwxrwxrwt %v", fi.Mode(), fi.ModTime(), mt)
	}
	if st := fi.Sys().(*syscall.Stat_t); st.Uid != 123 || st.Gid != 456 {
		t.Errorf("extracted root owned by %d:%d, want 123:456", st.Uid, st.Gid)
	}
}

// TestTarNotAnswered: anything but CRIU's create of a tree the proxy archives
// itself (or its extract of an archive the proxy reads) goes
// to the real tar (LAZYFORK_TAR_REAL, or the first other tar on PATH), with
// the same arguments and standard input.
func TestTarNotAnswered(t *testing.T) {
	_, proxyTar, _ := proxy(t)
	spyDir := t.TempDir()
	spy := filepath.Join(spyDir, "tar")
	if err := os.WriteFile(spy, []byte("#!/bin/sh\necho \"real tar $*\"\nls -A /proc/self/fd/0 2>&1 | head -1\n"), 0o755); err != nil {
		t.Fatal(err)
	}
	env := []string{EnvTarReal + "=" + spy}
	dir := t.TempDir()
	other := append([]string{}, criuCreate...)
	other[len(other)-1] = "sub"
	extract := []string{"--extract", "--gzip", "--no-unquote", "--no-wildcards", "--directory", "/x"}
	for _, args := range [][]string{nil, extract, other, criuCreate[:len(criuCreate)-1], append(criuCreate, "x")} {
		out := runTar(t, proxyTar, env, dir, args...)
		if want := "real tar " + joinArgs(args) + "\n"; string(out) != want {
			t.Errorf("args %q: %q, want the real tar's %q", args, out, want)
		}
	}
	// A file linked twice (GNU tar writes a hard-link entry): not the
	// proxy's to write.
	if err := os.WriteFile(filepath.Join(dir, ".hidden"), nil, 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.Link(filepath.Join(dir, ".hidden"), filepath.Join(dir, ".hidden2")); err != nil {
		t.Fatal(err)
	}
	if out := runTar(t, proxyTar, env, dir, criuCreate...); string(out) != "real tar "+joinArgs(criuCreate)+"\n.hidden\n" {
		t.Errorf("a directory holding a hard link: %.200q, want the real tar's (reading the directory)", out)
	}
	if out := runTar(t, proxyTar, env, filepath.Join(dir, ".hidden"), criuCreate...); !bytes.HasPrefix(out, []byte("real tar --create")) {
		t.Errorf("a regular file on standard input: %q, want the real tar's", out)
	}
	// No LAZYFORK_TAR_REAL: the first tar on PATH that is not the proxy.
	pathEnv := []string{EnvTarReal + "=", "PATH=" + filepath.Dir(proxyTar) + ":" + spyDir + ":" + os.Getenv("PATH")}
	if out := runTar(t, proxyTar, pathEnv, dir, extract...); string(out) != "real tar "+joinArgs(extract)+"\n.hidden\n" {
		t.Errorf("no %s: %q, want the spy's (next on PATH)", EnvTarReal, out)
	}
}

func joinArgs(a []string) string { return strings.Join(a, " ") }
