package criuproxy

import (
	"bytes"
	"compress/gzip"
	"encoding/binary"
	"fmt"
	"hash/crc32"
	"io"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/lazyfork/lazyfork/internal/testutil"
)

// criuExtract is the argument list CRIU 4.1 runs tar with to restore a tmpfs
// mount's contents (criu/filesystems.c, tmpfs_restore), then the new mount's
// directory, the archive (the image file) on standard input.
var criuExtract = []string{"--extract", "--gzip", "--no-unquote", "--no-wildcards", "--directory"}

// node is one entry of a test tree: path relative to the root ("" is the
// root), kind 'd' 'l' 'c' 'b' 'p' 'f', the permission bits with set-id and
// sticky bits (unix), owner, device numbers, link target, contents, mtime.
type node struct {
	path     string
	kind     byte
	mode     uint32
	uid, gid int
	maj, min uint32
	link     string
	data     string
	mtime    int64
}

// mkTree makes the nodes under root (which it creates, and mounts a new
// tmpfs on if tmpfs): in the order given (a directory's listing order
// follows it), each owner then mode then time, directories' times last,
// deepest first.
func mkTree(t *testing.T, root string, nodes []node, tmpfs ...bool) {
	t.Helper()
	if err := os.Mkdir(root, 0o700); err != nil {
		t.Fatal(err)
	}
	if len(tmpfs) > 0 && tmpfs[0] {
		must(t, unix.Mount("tmpfs", root, "tmpfs", 0, "size=16m"))
		t.Cleanup(func() { unix.Unmount(root, unix.MNT_DETACH) })
	}
	for _, n := range nodes {
		p := filepath.Join(root, n.path)
		var err error
		switch n.kind {
		case 'd':
			if n.path != "" {
				err = os.Mkdir(p, 0o700)
			}
		case 'l':
			err = os.Symlink(n.link, p)
		case 'c':
			err = unix.Mknod(p, unix.S_IFCHR|0o600, int(unix.Mkdev(n.maj, n.min)))
		case 'b':
			err = unix.Mknod(p, unix.S_IFBLK|0o600, int(unix.Mkdev(n.maj, n.min)))
		case 'p':
			err = unix.Mkfifo(p, 0o600)
		case 'f':
			err = os.WriteFile(p, []byte(n.data), 0o600)
		}
		if err != nil {
			t.Fatal(err)
		}
		if err := os.Lchown(p, n.uid, n.gid); err != nil {
			t.Fatal(err)
		}
		if n.kind != 'l' {
			if err := unix.Fchmodat(unix.AT_FDCWD, p, n.mode, 0); err != nil {
				t.Fatal(err)
			}
		}
		if n.kind != 'd' {
			setMtime(t, p, n.mtime)
		}
	}
	for i := len(nodes) - 1; i >= 0; i-- {
		if n := nodes[i]; n.kind == 'd' {
			setMtime(t, filepath.Join(root, n.path), n.mtime)
		}
	}
}

func setMtime(t *testing.T, p string, sec int64) {
	t.Helper()
	ts := []unix.Timespec{{Nsec: unix.UTIME_OMIT}, {Sec: sec, Nsec: 123456789}}
	if err := unix.UtimesNanoAt(unix.AT_FDCWD, p, ts, unix.AT_SYMLINK_NOFOLLOW); err != nil {
		t.Fatal(err)
	}
}

// walkTree describes every entry under root (root itself as "."), one line
// each: type, mode with set-id and sticky bits, owner, device numbers, link
// target, whole seconds of the mtime, size and contents of regular files.
func walkTree(t *testing.T, root string) []string {
	t.Helper()
	var out []string
	err := filepath.WalkDir(root, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		var st unix.Stat_t
		if err := unix.Lstat(p, &st); err != nil {
			return err
		}
		rel, _ := filepath.Rel(root, p)
		line := fmt.Sprintf("%s %o %o %d:%d", rel, st.Mode&unix.S_IFMT, st.Mode&0o7777, st.Uid, st.Gid)
		switch st.Mode & unix.S_IFMT {
		case unix.S_IFCHR, unix.S_IFBLK:
			line += fmt.Sprintf(" dev %d:%d", unix.Major(st.Rdev), unix.Minor(st.Rdev))
		case unix.S_IFLNK:
			l, err := os.Readlink(p)
			if err != nil {
				return err
			}
			line += " -> " + l
		case unix.S_IFREG:
			b, err := os.ReadFile(p)
			if err != nil {
				return err
			}
			line += fmt.Sprintf(" %d %q", len(b), b)
		}
		out = append(out, line+fmt.Sprintf(" mtime %d", st.Mtim.Sec))
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	slices.Sort(out)
	return out
}

// runcDev is a runc container's /dev as CRIU dumps it (runc's device nodes,
// its symlinks, the directories of the mounts on it; /dev/console the empty
// file runc mounts the terminal on).
var runcDev = []node{
	{path: "", kind: 'd', mode: 0o755, mtime: 1764650000},
	{path: "null", kind: 'c', mode: 0o666, maj: 1, min: 3, mtime: 1764650001},
	{path: "zero", kind: 'c', mode: 0o666, maj: 1, min: 5, mtime: 1764650001},
	{path: "full", kind: 'c', mode: 0o666, maj: 1, min: 7, mtime: 1764650001},
	{path: "random", kind: 'c', mode: 0o666, maj: 1, min: 8, mtime: 1764650001},
	{path: "urandom", kind: 'c', mode: 0o666, maj: 1, min: 9, mtime: 1764650001},
	{path: "tty", kind: 'c', mode: 0o666, maj: 5, min: 0, mtime: 1764650001},
	{path: "pts", kind: 'd', mode: 0o755, mtime: 1764650002},
	{path: "shm", kind: 'd', mode: 0o1777, mtime: 1764650002},
	{path: "mqueue", kind: 'd', mode: 0o1777, mtime: 1764650002},
	{path: "ptmx", kind: 'l', link: "pts/ptmx", mode: 0o777, mtime: 1764650003},
	{path: "fd", kind: 'l', link: "/proc/self/fd", mode: 0o777, mtime: 1764650003},
	{path: "stdin", kind: 'l', link: "/proc/self/fd/0", mode: 0o777, mtime: 1764650003},
	{path: "stdout", kind: 'l', link: "/proc/self/fd/1", mode: 0o777, mtime: 1764650003},
	{path: "stderr", kind: 'l', link: "/proc/self/fd/2", mode: 0o777, mtime: 1764650003},
	{path: "core", kind: 'l', link: "/proc/kcore", mode: 0o777, mtime: 1764650003},
	{path: "console", kind: 'f', mode: 0o620, gid: 5, mtime: 1764650004},
}

// oddTree has odd modes and owners (set-id and sticky bits on directories,
// device nodes and files; owners beyond 16 bits), nested directories, a
// block device and fifos, small files, long-ish names and link targets (99
// bytes in the archive: the most a header holds without a long-name entry),
// times from 0 to 2100, and symlinks leading out of the tree.
func oddTree() []node {
	long := strings.Repeat("n", 97)    // "./" + 97 = 99 bytes
	longDir := strings.Repeat("d", 40) // "./" + 40 + "/" + 55 + "/" = 99
	return []node{
		{path: "", kind: 'd', mode: 0o1777, uid: 1000, gid: 1001, mtime: 1700000000},
		{path: "zz-first", kind: 'c', mode: 0o4666, uid: 5, gid: 6, maj: 1, min: 3, mtime: 0},
		{path: "a", kind: 'd', mode: 0o500, uid: 65534, gid: 65534, mtime: 1600000000},
		{path: "a/b", kind: 'd', mode: 0o2750, uid: 123456, gid: 7, mtime: 4102444800},
		{path: "a/b/blk", kind: 'b', mode: 0o2660, gid: 6, maj: 8, min: 1, mtime: 1500000000},
		{path: "a/b/big-minor", kind: 'c', mode: 0o600, maj: 4095, min: 1048575, mtime: 1500000001},
		{path: "a/b/fifo", kind: 'p', mode: 0o1600, uid: 33, gid: 33, mtime: 1500000002},
		{path: "a/b/empty", kind: 'd', mode: 0o700, mtime: 1500000003},
		{path: "a/up", kind: 'l', link: "../../etc/passwd", uid: 1000, gid: 1000, mtime: 1400000000},
		{path: "a/abs", kind: 'l', link: "/", mtime: 1400000001},
		{path: "a/file", kind: 'f', mode: 0o4755, uid: 1, gid: 2, data: "shm-data\n", mtime: 1300000000},
		{path: "b-after-a", kind: 'f', mode: 0o444, data: strings.Repeat("0123456789abcdef", 300), mtime: 1300000001},
		{path: "empty-file", kind: 'f', mode: 0o000, mtime: 1300000002},
		{path: long, kind: 'p', mode: 0o644, mtime: 1200000000},
		{path: "l", kind: 'l', link: strings.Repeat("t", 99), mtime: 1200000001},
		{path: longDir, kind: 'd', mode: 0o3777, uid: 2097151, gid: 2097151, mtime: 1100000000},
		{path: longDir + "/" + strings.Repeat("e", 55), kind: 'd', mode: 0o755, mtime: 1100000001},
		{path: "x", kind: 'd', mode: 0o755, mtime: 1000000000},
		{path: "x/y", kind: 'd', mode: 0o755, mtime: 1000000001},
		{path: "x/y/z", kind: 'd', mode: 0o755, mtime: 1000000002},
		{path: "x/y/z/w", kind: 'c', mode: 0o640, maj: 10, min: 200, mtime: 1000000003},
		{path: "x/y/z/v", kind: 'l', link: ".", mtime: 1000000004},
		{path: "ptmx", kind: 'l', link: "pts/ptmx", mtime: 1000000005},
	}
}

// tarTools are a root test's proxy tar, GNU tar, and the environment and log
// of a spy in front of GNU tar (which shows whether the proxy ran it).
func tarTools(t *testing.T) (proxyTar, real string, spyEnv []string, log string) {
	t.Helper()
	testutil.RequiresRoot(t)
	_, proxyTar, _ = proxy(t)
	real = gnuTar(t)
	spyEnv, log = tarSpy(t, real)
	return proxyTar, real, spyEnv, log
}

// gunzip decompresses one gzip stream.
func gunzip(t *testing.T, b []byte) []byte {
	t.Helper()
	zr, err := gzip.NewReader(bytes.NewReader(b))
	if err != nil {
		t.Fatal(err)
	}
	raw, err := io.ReadAll(zr)
	if err != nil {
		t.Fatalf("gunzip: %v", err)
	}
	return raw
}

// extractWith runs bin with CRIU's extract arguments into a new empty
// directory, the archive on standard input (a regular file, as CRIU's image,
// or a pipe); it returns the directory, the output and the error.
func extractWith(t *testing.T, bin string, env []string, archive []byte, pipe bool) (string, []byte, error) {
	t.Helper()
	dst := filepath.Join(t.TempDir(), "mnt")
	if err := os.Mkdir(dst, 0o755); err != nil {
		t.Fatal(err)
	}
	out, err := extractInto(t, bin, env, archive, pipe, dst)
	return dst, out, err
}

func extractInto(t *testing.T, bin string, env []string, archive []byte, pipe bool, dst string) ([]byte, error) {
	t.Helper()
	cmd := exec.Command(bin, append(append([]string{}, criuExtract...), dst)...)
	cmd.Env = append(os.Environ(), env...)
	if pipe {
		cmd.Stdin = bytes.NewReader(archive)
	} else {
		f := filepath.Join(t.TempDir(), "tmpfs-dev.img")
		if err := os.WriteFile(f, archive, 0o600); err != nil {
			t.Fatal(err)
		}
		in, err := os.Open(f)
		if err != nil {
			t.Fatal(err)
		}
		defer in.Close()
		cmd.Stdin = in
	}
	out, err := cmd.CombinedOutput()
	return out, err
}

// tarSpy is a tar that logs its arguments to dir/tar.log and runs GNU tar.
func tarSpy(t *testing.T, real string) (env []string, log string) {
	t.Helper()
	dir := t.TempDir()
	log = filepath.Join(dir, "tar.log")
	script := "#!/bin/sh\necho \"$*\" >>" + log + "\nexec " + real + " \"$@\"\n"
	if err := os.WriteFile(filepath.Join(dir, "tar"), []byte(script), 0o755); err != nil {
		t.Fatal(err)
	}
	return []string{EnvTarReal + "=" + filepath.Join(dir, "tar")}, log
}

func spyRuns(t *testing.T, log string) string {
	t.Helper()
	b, err := os.ReadFile(log)
	if err != nil && !os.IsNotExist(err) {
		t.Fatal(err)
	}
	os.Remove(log)
	return string(b)
}

// noRealTar makes any run of the real tar fail: the proxy must answer.
var noRealTar = []string{EnvTarReal + "=/bin/false"}

// TestTarTreeSameAsGNUTar: for a runc container's /dev and a tree of odd
// modes, owners, times and names, the proxy answers CRIU's dump itself (the
// real tar would fail) with the tar stream GNU tar writes, byte for byte
// (headers, order, end blocks, padding to the 10240-byte record); the gzip
// header is gzip's too, only the deflate blocks differ (stored, not
// compressed: any inflater reads both). The proxy extracts its own archive
// itself (again the real tar would fail) into the tree GNU tar extracts from
// it with CRIU's arguments: the dumped tree, entry by entry.
func TestTarTreeSameAsGNUTar(t *testing.T) {
	testutil.RequiresRoot(t)
	_, proxyTar, _ := proxy(t)
	real := gnuTar(t)
	for _, c := range []struct {
		name  string
		nodes []node
		tmpfs bool // the tree on a tmpfs of its own, as CRIU's
	}{{"runc-dev", runcDev, false}, {"runc-dev-tmpfs", runcDev, true}, {"odd", oddTree(), false}, {"odd-tmpfs", oddTree(), true}} {
		nodes := c.nodes
		t.Run(c.name, func(t *testing.T) {
			src := filepath.Join(t.TempDir(), "src")
			mkTree(t, src, nodes, c.tmpfs)
			ours := runTar(t, proxyTar, noRealTar, src, criuCreate...)
			theirs := runTar(t, real, nil, src, criuCreate...)
			if !bytes.Equal(ours[:10], theirs[:10]) {
				t.Errorf("gzip header % x, gzip's % x", ours[:10], theirs[:10])
			}
			got, want := gunzip(t, ours), gunzip(t, theirs)
			if !bytes.Equal(got, want) {
				for i := 0; i < len(got) && i < len(want); i += 512 {
					if !bytes.Equal(got[i:i+512], want[i:i+512]) {
						t.Fatalf("tar streams differ in block %d:\n% x\nGNU tar's:\n% x", i/512, got[i:i+512], want[i:i+512])
					}
				}
				t.Fatalf("tar stream of %d bytes, GNU tar's %d", len(got), len(want))
			}
			srcTree := walkTree(t, src)
			ourDir, out, err := extractWith(t, proxyTar, noRealTar, ours, false)
			if err != nil {
				t.Fatalf("the proxy's extraction: %v: %s", err, out)
			}
			// (GNU tar warns of the time in 2100, "in the future".)
			gnuDir, out, err := extractWith(t, real, nil, ours, false)
			if err != nil {
				t.Fatalf("GNU tar's extraction: %v: %s", err, out)
			}
			gotTree, wantTree := walkTree(t, ourDir), walkTree(t, gnuDir)
			if !slices.Equal(gotTree, wantTree) {
				t.Errorf("the proxy extracted\n%s\nGNU tar\n%s", strings.Join(gotTree, "\n"), strings.Join(wantTree, "\n"))
			}
			if !slices.Equal(gotTree, srcTree) {
				t.Errorf("the proxy extracted\n%s\nthe dumped tree is\n%s", strings.Join(gotTree, "\n"), strings.Join(srcTree, "\n"))
			}
			// A pipe on standard input works the same.
			pipeDir, out, err := extractWith(t, proxyTar, noRealTar, ours, true)
			if err != nil {
				t.Fatalf("the proxy's extraction from a pipe: %v: %s", err, out)
			}
			if tr := walkTree(t, pipeDir); !slices.Equal(tr, wantTree) {
				t.Errorf("the proxy extracted from a pipe\n%s\nGNU tar\n%s", strings.Join(tr, "\n"), strings.Join(wantTree, "\n"))
			}
		})
	}
}

// TestTarTreeFallsBack: trees GNU tar archives otherwise than the proxy
// writes (long names and link targets, owners beyond octal, hard links,
// of symlinks too,
// sparse and large files, sockets, another file system below) go to the
// real tar; CRIU gets its archive.
func TestTarTreeFallsBack(t *testing.T) {
	proxyTar, real, spyEnv, log := tarTools(t)
	base := []node{{path: "", kind: 'd', mode: 0o755, mtime: 1700000000}, {path: "null", kind: 'c', mode: 0o666, maj: 1, min: 3}}
	for name, extra := range map[string]func(t *testing.T, dir string){
		"name of 100 bytes": func(t *testing.T, dir string) { mkfile(t, filepath.Join(dir, strings.Repeat("n", 98)), 0) },
		"link of 100 bytes": func(t *testing.T, dir string) { must(t, os.Symlink(strings.Repeat("t", 100), filepath.Join(dir, "l"))) },
		"uid beyond octal": func(t *testing.T, dir string) {
			p := filepath.Join(dir, "f")
			mkfile(t, p, 0)
			must(t, os.Lchown(p, 2097152, 0))
		},
		"hard link": func(t *testing.T, dir string) {
			mkfile(t, filepath.Join(dir, "f"), 10)
			must(t, os.Link(filepath.Join(dir, "f"), filepath.Join(dir, "g")))
		},
		"hard-linked symlink": func(t *testing.T, dir string) {
			must(t, os.Symlink("null", filepath.Join(dir, "sym")))
			must(t, unix.Linkat(unix.AT_FDCWD, filepath.Join(dir, "sym"), unix.AT_FDCWD, filepath.Join(dir, "hl"), 0))
		},
		"sparse file": func(t *testing.T, dir string) { must(t, os.Truncate(mkfile(t, filepath.Join(dir, "s"), 0), 1<<20)) },
		"large file":  func(t *testing.T, dir string) { mkfile(t, filepath.Join(dir, "big"), 1<<20+1) },
		"socket": func(t *testing.T, dir string) {
			fd, err := unix.Socket(unix.AF_UNIX, unix.SOCK_STREAM, 0)
			must(t, err)
			defer unix.Close(fd)
			must(t, unix.Bind(fd, &unix.SockaddrUnix{Name: filepath.Join(dir, "sock")}))
		},
		"mount below": func(t *testing.T, dir string) {
			sub := filepath.Join(dir, "shm")
			must(t, os.Mkdir(sub, 0o755))
			must(t, unix.Mount("tmpfs", sub, "tmpfs", 0, ""))
			t.Cleanup(func() { unix.Unmount(sub, unix.MNT_DETACH) })
			mkfile(t, filepath.Join(sub, "inside"), 3)
		},
	} {
		t.Run(strings.ReplaceAll(name, " ", "-"), func(t *testing.T) {
			src := filepath.Join(t.TempDir(), "src")
			mkTree(t, src, base)
			extra(t, src)
			spyRuns(t, log)
			ours := runTar(t, proxyTar, spyEnv, src, criuCreate...)
			if l := spyRuns(t, log); !strings.Contains(l, "--create") {
				t.Errorf("the real tar did not run (log %q)", l)
			}
			if got, want := gunzip(t, ours), gunzip(t, runTar(t, real, nil, src, criuCreate...)); !bytes.Equal(got, want) {
				t.Errorf("the archive (%d bytes of tar) is not GNU tar's (%d)", len(got), len(want))
			}
		})
	}
}

func must(t *testing.T, err error) {
	t.Helper()
	if err != nil {
		t.Fatal(err)
	}
}

func mkfile(t *testing.T, p string, size int) string {
	t.Helper()
	must(t, os.WriteFile(p, bytes.Repeat([]byte{'x'}, size), 0o644))
	return p
}

// TestTarExtractFallsBack: archives the proxy does not write (GNU tar's
// deflate-compressed ones) and a target that is not empty go to the real
// tar with standard input as it came (a regular file read from where CRIU
// left it, or a pipe), and extract as GNU tar does.
func TestTarExtractFallsBack(t *testing.T) {
	proxyTar, real, spyEnv, log := tarTools(t)
	src := filepath.Join(t.TempDir(), "src")
	mkTree(t, src, runcDev)
	compressed := runTar(t, real, nil, src, criuCreate...)
	want := walkTree(t, src)
	for _, pipe := range []bool{false, true} {
		spyRuns(t, log)
		dir, out, err := extractWith(t, proxyTar, spyEnv, compressed, pipe)
		if err != nil {
			t.Fatalf("pipe %v: %v: %s", pipe, err, out)
		}
		if l := spyRuns(t, log); !strings.Contains(l, "--extract") {
			t.Errorf("pipe %v: the real tar did not run (log %q)", pipe, l)
		}
		if got := walkTree(t, dir); !slices.Equal(got, want) {
			t.Errorf("pipe %v: extracted\n%s\nwant\n%s", pipe, strings.Join(got, "\n"), strings.Join(want, "\n"))
		}
	}
	// The proxy's own archive into a directory holding something: the real
	// tar, which replaces or keeps what is there as it does.
	ours := runTar(t, proxyTar, noRealTar, src, criuCreate...)
	dst := filepath.Join(t.TempDir(), "mnt")
	must(t, os.Mkdir(dst, 0o755))
	mkfile(t, filepath.Join(dst, "null"), 4)
	if out, err := extractInto(t, proxyTar, spyEnv, ours, false, dst); err != nil {
		t.Fatalf("into a full directory: %v: %s", err, out)
	}
	if l := spyRuns(t, log); !strings.Contains(l, "--extract") {
		t.Errorf("into a full directory: the real tar did not run (log %q)", l)
	}
	if got := walkTree(t, dst); !slices.Equal(got, want) {
		t.Errorf("into a full directory: extracted\n%s\nwant\n%s", strings.Join(got, "\n"), strings.Join(want, "\n"))
	}
}

// gnuHeader is a GNU-format header as GNU tar writes one (numeric owner).
func gnuHeader(name string, typ byte, mode, size int, link string) []byte {
	h := make([]byte, 512)
	copy(h, name)
	copy(h[100:], fmt.Sprintf("%07o\x00%07o\x00%07o\x00%011o\x00%011o\x00", mode, 0, 0, size, 1700000000))
	copy(h[148:], "        ")
	h[156] = typ
	copy(h[157:], link)
	copy(h[257:], "ustar  \x00")
	sum := 0
	for _, c := range h {
		sum += int(c)
	}
	copy(h[148:], fmt.Sprintf("%06o\x00", sum))
	return h
}

// tarOf is the entries, two zero blocks and the record's padding.
func tarOf(blocks ...[]byte) []byte {
	b := bytes.Join(blocks, nil)
	return append(b, make([]byte, (len(b)+1024+10239)/10240*10240-len(b))...)
}

// storedGzip is a gzip of stored deflate blocks, as the proxy writes.
func storedGzip(p []byte) []byte {
	out := []byte{0x1f, 0x8b, 8, 0, 0, 0, 0, 0, 0, 3}
	for off := 0; ; {
		n := min(len(p)-off, 65535)
		final := byte(0)
		if off+n == len(p) {
			final = 1
		}
		out = append(out, final, byte(n), byte(n>>8), ^byte(n), ^byte(n>>8))
		out = append(out, p[off:off+n]...)
		if off += n; off == len(p) {
			break
		}
	}
	out = binary.LittleEndian.AppendUint32(out, crc32.ChecksumIEEE(p))
	return binary.LittleEndian.AppendUint32(out, uint32(len(p)))
}

// TestTarExtractRefusesMalicious: archives naming entries outside the
// directory ("../", absolute, through a symlink the archive made), or
// broken ones (truncated, a bad header checksum, a bad CRC-32), are refused
// by the proxy's extraction before it writes anything, and go to the real
// tar, which is what CRIU runs without the proxy (it strips leading "/",
// skips members with "..", puts placeholders for symlinks that could lead
// out, and fails on broken streams): nothing is written outside the
// directory either way. The well-formed archive they are made from is
// extracted by the proxy.
func TestTarExtractRefusesMalicious(t *testing.T) {
	proxyTar, _, spyEnv, log := tarTools(t)
	base := t.TempDir()
	outside := filepath.Join(base, "outside")
	must(t, os.Mkdir(outside, 0o755))
	root := gnuHeader("./", '5', 0o755, 0, "")
	file := func(name string) []byte {
		return append(gnuHeader(name, '0', 0o644, 5, ""), append([]byte("evil\n"), make([]byte, 507)...)...)
	}
	good := storedGzip(tarOf(root, file("./ok")))
	badSum := tarOf(root, file("./ok"))
	badSum[512+1] = 'O'
	badCRC := append([]byte{}, good...)
	badCRC[len(badCRC)-8] ^= 1
	absDir := strings.TrimPrefix(outside, "/")
	for name, archive := range map[string][]byte{
		"dot-dot":            storedGzip(tarOf(root, file("./../evil"))),
		"dot-dot-no-prefix":  storedGzip(tarOf(root, file("../evil"))),
		"dot-dot-inside":     storedGzip(tarOf(root, gnuHeader("./a/", '5', 0o755, 0, ""), file("./a/../../evil"))),
		"dot-dot-last":       storedGzip(tarOf(root, gnuHeader("./a/", '5', 0o755, 0, ""), gnuHeader("./a/..", '6', 0o644, 0, ""))),
		"absolute":           storedGzip(tarOf(root, file(outside+"/abs"))),
		"through-symlink":    storedGzip(tarOf(root, gnuHeader("./l", '2', 0o777, 0, "../outside"), file("./l/evil"))),
		"through-abs-link":   storedGzip(tarOf(root, gnuHeader("./m", '2', 0o777, 0, outside), file("./m/evil"))),
		"symlink-then-dir":   storedGzip(tarOf(root, gnuHeader("./n", '2', 0o777, 0, outside), gnuHeader("./n/", '5', 0o755, 0, ""), file("./n/evil"))),
		"truncated":          good[:len(good)/2],
		"bad-header-sum":     storedGzip(badSum),
		"bad-crc":            badCRC,
		"relative-to-abs":    storedGzip(tarOf(root, file("./"+absDir+"/../../evil"))),
		"duplicate-dir-file": storedGzip(tarOf(root, file("./d"), gnuHeader("./d/", '5', 0o755, 0, ""))),
	} {
		t.Run(name, func(t *testing.T) {
			dst := filepath.Join(base, "mnt")
			os.RemoveAll(dst)
			must(t, os.Mkdir(dst, 0o755))
			spyRuns(t, log)
			out, err := extractInto(t, proxyTar, spyEnv, archive, false, dst)
			t.Logf("the real tar: %v: %s", err, out)
			if l := spyRuns(t, log); !strings.Contains(l, "--extract") {
				t.Errorf("the proxy extracted it itself (the real tar did not run): %v: %s", err, out)
			}
			for _, d := range []string{base, outside} {
				ents, err := os.ReadDir(d)
				must(t, err)
				var names []string
				for _, e := range ents {
					names = append(names, e.Name())
				}
				if want := map[string]string{base: "mnt outside", outside: ""}[d]; strings.Join(names, " ") != want {
					t.Errorf("%s holds %q after the extraction, want %q", d, names, want)
				}
			}
		})
	}
	dst, out, err := extractWith(t, proxyTar, noRealTar, good, false)
	if err != nil {
		t.Fatalf("the well-formed archive: %v: %s", err, out)
	}
	if b, err := os.ReadFile(filepath.Join(dst, "ok")); err != nil || string(b) != "evil\n" {
		t.Errorf("the well-formed archive: ok holds %q (%v)", b, err)
	}
}

// TestTarExtractFailsPartWay: an error after the proxy wrote the first entry
// (here the new tmpfs runs out of inodes) ends it with a message and a
// failure, which fails CRIU's restore; the real tar is not run on the half
// extracted directory.
func TestTarExtractFailsPartWay(t *testing.T) {
	proxyTar, _, spyEnv, log := tarTools(t)
	src := filepath.Join(t.TempDir(), "src")
	mkTree(t, src, runcDev)
	ours := runTar(t, proxyTar, noRealTar, src, criuCreate...)
	dst := filepath.Join(t.TempDir(), "mnt")
	must(t, os.Mkdir(dst, 0o755))
	must(t, unix.Mount("tmpfs", dst, "tmpfs", 0, "nr_inodes=4"))
	t.Cleanup(func() { unix.Unmount(dst, unix.MNT_DETACH) })
	out, err := extractInto(t, proxyTar, spyEnv, ours, false, dst)
	if err == nil || !strings.Contains(string(out), "failed part way") {
		t.Errorf("extracting into a tmpfs of 4 inodes: %v: %s; want a failure saying it failed part way", err, out)
	}
	if l := spyRuns(t, log); l != "" {
		t.Errorf("the real tar ran after the proxy had written: %q", l)
	}
}
