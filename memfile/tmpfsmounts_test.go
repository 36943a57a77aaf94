package memfile

import (
	"archive/tar"
	"bytes"
	"compress/gzip"
	"os"
	"path/filepath"
	"slices"
	"testing"

	"github.com/checkpoint-restore/go-criu/v7/crit/images/mnt"
	"google.golang.org/protobuf/proto"

	"github.com/lazyfork/lazyfork/criuimg"
)

// testdata/tmpfsmounts is the mount part of CRIU 4.1.1's dump of a LazyFork
// container (python image, `sleep infinity`, runc 1.3): its mountpoints
// image and the tar images of its four tmpfs superblocks. /dev (dev 58)
// holds runc's device nodes; /dev/shm (60), /run (62) and the one read-only
// tmpfs runc mounts over /proc/acpi and /sys/firmware (63) hold only their
// root directories. /proc/interrupts, /proc/keys and /proc/timer_list are
// runc's external binds of /dev/null (dev 58, root /null).
const tmpfsFixture = "testdata/tmpfsmounts"

// stageMounts links the fixture's files into a fresh directory, as
// stageImage links a dump's, and returns it and the fixture's bytes.
func stageMounts(t *testing.T) (string, map[string][]byte) {
	t.Helper()
	src := t.TempDir()
	dir := t.TempDir()
	ents, err := os.ReadDir(tmpfsFixture)
	if err != nil {
		t.Fatal(err)
	}
	orig := map[string][]byte{}
	for _, e := range ents {
		b, err := os.ReadFile(filepath.Join(tmpfsFixture, e.Name()))
		if err != nil {
			t.Fatal(err)
		}
		orig[e.Name()] = b
		if err := os.WriteFile(filepath.Join(src, e.Name()), b, 0o644); err != nil {
			t.Fatal(err)
		}
		if err := os.Link(filepath.Join(src, e.Name()), filepath.Join(dir, e.Name())); err != nil {
			t.Fatal(err)
		}
	}
	t.Cleanup(func() {
		// The dump's files behind the hard links are untouched.
		for name, b := range orig {
			if got, err := os.ReadFile(filepath.Join(src, name)); err != nil || !bytes.Equal(got, b) {
				t.Errorf("the dump's %s changed (%v)", name, err)
			}
		}
	})
	return dir, orig
}

// readMounts reads a mountpoints image by mount point (the first entry of
// each: the fixture has two of /proc/sys/vm/overcommit_memory).
func readMounts(t *testing.T, p string) map[string]*mnt.MntEntry {
	t.Helper()
	img, err := criuimg.ReadImage(p, criuimg.MagicMnts, criuimg.KindOf(p).NewEntry)
	if err != nil {
		t.Fatal(err)
	}
	out := map[string]*mnt.MntEntry{}
	for _, e := range img.Entries {
		m := e.(*mnt.MntEntry)
		if _, ok := out[mountPath(m.GetMountpoint())]; !ok {
			out[mountPath(m.GetMountpoint())] = m
		}
	}
	return out
}

// tarGz is a tmpfs tar image holding the given entries.
func tarGz(t *testing.T, hs ...*tar.Header) []byte {
	t.Helper()
	var b bytes.Buffer
	zw := gzip.NewWriter(&b)
	tw := tar.NewWriter(zw)
	for _, h := range hs {
		if err := tw.WriteHeader(h); err != nil {
			t.Fatal(err)
		}
		if _, err := tw.Write(make([]byte, h.Size)); err != nil {
			t.Fatal(err)
		}
	}
	if err := tw.Close(); err != nil {
		t.Fatal(err)
	}
	if err := zw.Close(); err != nil {
		t.Fatal(err)
	}
	return b.Bytes()
}

// TestAutoMountEmptyTmpfs: on a real container dump, the empty tmpfs
// mounts (/dev/shm, /run, and both mounts of the masked directories' tmpfs)
// become new-tmpfs (AUTO) mounts and lose their tar images; /dev, which
// holds device nodes, and its binds keep CRIU's tar path; nothing else of
// any entry changes, and the dump's own files behind the staged links do
// not change. A second pass changes nothing.
func TestAutoMountEmptyTmpfs(t *testing.T) {
	dir, _ := stageMounts(t)
	mp := filepath.Join(dir, "mountpoints-13.img")
	before := readMounts(t, mp)

	turned, err := autoMountEmptyTmpfs(dir)
	if err != nil {
		t.Fatal(err)
	}
	want := []string{"/dev/shm", "/proc/acpi", "/run", "/sys/firmware"}
	if !slices.Equal(turned, want) {
		t.Errorf("turned %v, want %v", turned, want)
	}
	after := readMounts(t, mp)
	if len(after) != len(before) {
		t.Fatalf("%d mounts after, %d before", len(after), len(before))
	}
	for path, b := range before {
		a := after[path]
		exp := proto.Clone(b).(*mnt.MntEntry)
		if slices.Contains(want, path) {
			exp.Fstype = ptr(uint32(mnt.Fstype_AUTO))
			exp.Fsname = ptr("tmpfs")
		}
		if !proto.Equal(a, exp) {
			t.Errorf("%s:\n got %v\nwant %v", path, a, exp)
		}
	}
	for dev, kept := range map[string]bool{"58": true, "60": false, "62": false, "63": false} {
		_, err := os.Stat(filepath.Join(dir, "tmpfs-dev-"+dev+".tar.gz.img"))
		if got := err == nil; got != kept {
			t.Errorf("tmpfs-dev-%s.tar.gz.img kept: %v, want %v", dev, got, kept)
		}
	}

	again, err := autoMountEmptyTmpfs(dir)
	if err != nil || len(again) != 0 {
		t.Errorf("second pass turned %v (%v), want nothing", again, err)
	}
}

// TestAutoMountEmptyTmpfsKeeps: a tmpfs whose tar holds a file, or whose
// root directory's mode or owner differs from what its options give a new
// tmpfs, or whose tar image is missing or unreadable, keeps its entry and
// its tar image.
func TestAutoMountEmptyTmpfsKeeps(t *testing.T) {
	root := func(mode int64, uid int) *tar.Header {
		return &tar.Header{Name: "./", Typeflag: tar.TypeDir, Mode: mode, Uid: uid, Format: tar.FormatGNU}
	}
	shm := "tmpfs-dev-60.tar.gz.img" // /dev/shm: size=65536k, so 1777 root:root
	for name, img := range map[string][]byte{
		"a file":          tarGz(t, root(0o1777, 0), &tar.Header{Name: "./f", Typeflag: tar.TypeReg, Mode: 0o644, Size: 3, Format: tar.FormatGNU}),
		"an empty subdir": tarGz(t, root(0o1777, 0), &tar.Header{Name: "./d/", Typeflag: tar.TypeDir, Mode: 0o755, Format: tar.FormatGNU}),
		"mode 0755":       tarGz(t, root(0o755, 0)),
		"owner 1000":      tarGz(t, root(0o1777, 1000)),
		"not gzip":        []byte("junk"),
		"no image":        nil,
	} {
		t.Run(name, func(t *testing.T) {
			dir, _ := stageMounts(t)
			p := filepath.Join(dir, shm)
			if err := os.Remove(p); err != nil {
				t.Fatal(err)
			}
			if img != nil {
				if err := os.WriteFile(p, img, 0o644); err != nil {
					t.Fatal(err)
				}
			}
			turned, err := autoMountEmptyTmpfs(dir)
			if err != nil {
				t.Fatal(err)
			}
			if slices.Contains(turned, "/dev/shm") {
				t.Errorf("/dev/shm turned into a new tmpfs: %v", turned)
			}
			if m := readMounts(t, filepath.Join(dir, "mountpoints-13.img"))["/dev/shm"]; m.GetFstype() != uint32(mnt.Fstype_TMPFS) || m.Fsname != nil {
				t.Errorf("/dev/shm entry changed: %v", m)
			}
			if _, err := os.Stat(p); (err == nil) != (img != nil) {
				t.Errorf("tar image of /dev/shm: %v", err)
			}
			if !slices.Contains(turned, "/run") {
				t.Errorf("/run not turned: %v", turned)
			}
		})
	}
}

// TestTmpfsRoot: a new tmpfs's root directory has the
// mode, uid and gid its options name, or 1777 root:root.
func TestTmpfsRoot(t *testing.T) {
	for _, c := range []struct {
		opts     string
		mode     int64
		uid, gid int
		ok       bool
	}{
		{"size=65536k", 0o1777, 0, 0, true},
		{"size=65536k,mode=755", 0o755, 0, 0, true},
		{"size=4k,nr_inodes=1", 0o1777, 0, 0, true},
		{"mode=1700,uid=1000,gid=5,inode64", 0o1700, 1000, 5, true},
		{"mode=8", 0, 0, 0, false},
		{"uid=x", 0, 0, 0, false},
		{"", 0o1777, 0, 0, true},
	} {
		mode, uid, gid, ok := tmpfsRoot(c.opts)
		if ok != c.ok || ok && (mode != c.mode || uid != c.uid || gid != c.gid) {
			t.Errorf("tmpfsRoot(%q) = %o %d %d %v, want %o %d %d %v", c.opts, mode, uid, gid, ok, c.mode, c.uid, c.gid, c.ok)
		}
	}
}

// TestAutoMountEmptyTmpfsWholeSuperblock: the masked directories' tmpfs is
// one superblock mounted twice; when one of its mounts is not the dump's
// own (here: made an external mount), neither turns, so CRIU still sees
// one superblock.
func TestAutoMountEmptyTmpfsWholeSuperblock(t *testing.T) {
	dir, _ := stageMounts(t)
	p := filepath.Join(dir, "mountpoints-13.img")
	img, err := criuimg.ReadImage(p, criuimg.MagicMnts, criuimg.KindOf(p).NewEntry)
	if err != nil {
		t.Fatal(err)
	}
	for _, e := range img.Entries {
		if m := e.(*mnt.MntEntry); mountPath(m.GetMountpoint()) == "/sys/firmware" {
			m.ExtKey = ptr("/sys/firmware")
		}
	}
	if err := os.Remove(p); err != nil {
		t.Fatal(err)
	}
	if err := criuimg.WriteImage(p, img); err != nil {
		t.Fatal(err)
	}
	turned, err := autoMountEmptyTmpfs(dir)
	if err != nil {
		t.Fatal(err)
	}
	if want := []string{"/dev/shm", "/run"}; !slices.Equal(turned, want) {
		t.Errorf("turned %v, want %v", turned, want)
	}
	if m := readMounts(t, p)["/proc/acpi"]; m.GetFstype() != uint32(mnt.Fstype_TMPFS) {
		t.Errorf("/proc/acpi turned alone: %v", m)
	}
}
