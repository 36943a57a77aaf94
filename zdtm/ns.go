package main

import (
	"bufio"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"

	"golang.org/x/sys/unix"

	"github.com/lazyfork/lazyfork/internal/procfs"
)

// nsFlavor is zdtm.py's namespace flavour ('ns'): the test starts in new
// pid, mount, network, ipc and uts namespaces (zdtm's lib/ns.c), with the
// CRIU tree's test directory as its root (bind-mounted at root, holding
// copies of the libraries the tests need) and a tmpfs of device nodes as its
// /dev; CRIU dumps and restores the namespaces, /dev as an external mount.
//
// A copy maps its memory files from inside that root: the family
// directory is bind-mounted at memMount in it before the test starts, so
// the test's mount namespace holds it, and it is an external mount too
// (CRIU would otherwise archive the tmpfs and its files into the image), as
// the shim's mount of the family directory is in a container.
type nsFlavor struct {
	base      string // temporary directory: root/root and dev
	root, dev string
	testDir   string // the CRIU tree's test directory, bind-mounted at root
	mem       string // the family directory on the host
	userns    bool   // zdtm.py's uns flavour: a user namespace too
	mounted   []string
}

// memMount is where a test in the ns flavour sees the family's memory files.
const memMount = "/lazyfork-mem"

var nsRootDirs = []string{"/bin", "/sbin", "/etc", "/lib", "/lib64", "/dev", "/tmp", "/usr", "/proc", "/run"}

// newNSFlavor prepares the root as zdtm.py's ns_flavor does (make_tests_root,
// init), plus the memory-file mount.
func newNSFlavor(work, testDir, famDir string, userns bool) (*nsFlavor, error) {
	base, err := os.MkdirTemp(work, "nsroot-")
	if err != nil {
		return nil, err
	}
	f := &nsFlavor{base: base, root: filepath.Join(base, "root", "root"), dev: filepath.Join(base, "dev"), testDir: testDir, mem: famDir, userns: userns}
	fail := func(err error) (*nsFlavor, error) {
		f.close()
		return nil, err
	}
	for _, d := range []string{f.root, f.dev} {
		if err := os.MkdirAll(d, 0o755); err != nil {
			return fail(err)
		}
	}
	// Searchable by the test's root in a user namespace (another uid).
	for _, d := range []string{base, filepath.Dir(f.root)} {
		if err := os.Chmod(d, 0o755); err != nil {
			return fail(err)
		}
	}
	// The file system under work may be nodev: /dev is a tmpfs of its own.
	if err := f.mount("criu-test-dev", f.dev, "tmpfs", 0, ""); err != nil {
		return fail(err)
	}
	os.Chmod(f.dev, 0o777)
	if err := f.mount(testDir, f.root, "", unix.MS_BIND, ""); err != nil {
		return fail(err)
	}
	if err := unix.Mount("", f.root, "", unix.MS_PRIVATE, ""); err != nil {
		return fail(fmt.Errorf("make %s private: %w", f.root, err))
	}
	for _, d := range nsRootDirs {
		if err := os.MkdirAll(f.root+d, 0o777); err != nil {
			return fail(err)
		}
	}
	for _, d := range []string{"/bin", "/sbin", "/lib", "/lib64"} {
		if _, err := os.Lstat(f.root + "/usr" + d); os.IsNotExist(err) {
			if err := os.Symlink(".."+d, f.root+"/usr"+d); err != nil {
				return fail(err)
			}
		}
	}
	for _, d := range []string{"pts", "net"} {
		if err := os.MkdirAll(filepath.Join(f.dev, d), 0o755); err != nil {
			return fail(err)
		}
	}
	for name, dev := range map[string]uint64{"tty": unix.Mkdev(5, 0), "null": unix.Mkdev(1, 3), "autofs": unix.Mkdev(10, 235)} {
		if err := unix.Mknod(filepath.Join(f.dev, name), unix.S_IFCHR|0o666, int(dev)); err != nil {
			return fail(fmt.Errorf("mknod %s: %w", name, err))
		}
		os.Chmod(filepath.Join(f.dev, name), 0o666)
	}
	for _, name := range []string{"net/tun", "rtc"} {
		var st unix.Stat_t
		if unix.Stat("/dev/"+name, &st) == nil {
			if err := unix.Mknod(filepath.Join(f.dev, name), unix.S_IFCHR|0o666, int(st.Rdev)); err == nil {
				os.Chmod(filepath.Join(f.dev, name), 0o666)
			}
		}
	}
	if err := os.MkdirAll(f.root+memMount, 0o755); err != nil {
		return fail(err)
	}
	if err := f.mount(famDir, f.root+memMount, "", unix.MS_BIND, ""); err != nil {
		return fail(err)
	}
	if err := unix.Mount("", f.root+memMount, "", unix.MS_PRIVATE, ""); err != nil {
		return fail(fmt.Errorf("make %s private: %w", f.root+memMount, err))
	}
	return f, nil
}

func (f *nsFlavor) mount(src, dst, fstype string, flags uintptr, data string) error {
	if err := unix.Mount(src, dst, fstype, flags, data); err != nil {
		return fmt.Errorf("mount %s on %s: %w", src, dst, err)
	}
	f.mounted = append(f.mounted, dst)
	return nil
}

// close unmounts what newNSFlavor mounted and removes the temporary root.
func (f *nsFlavor) close() {
	for i := len(f.mounted) - 1; i >= 0; i-- {
		unix.Unmount(f.mounted[i], unix.MNT_DETACH)
	}
	f.mounted = nil
	os.RemoveAll(f.base)
}

// prepare copies into the root the libraries test t's binary needs (ldd), as
// zdtm.py does for each test.
func (f *nsFlavor) prepare(bin string) error {
	if f.userns {
		// The test's root in its user namespace is another uid: it needs
		// write access to the test directory for its .out and .pid files.
		dir := filepath.Dir(bin)
		if st, err := os.Stat(dir); err == nil {
			os.Chmod(dir, st.Mode().Perm()|0o222)
		}
	}
	out, err := exec.Command("ldd", bin).Output()
	if err != nil {
		return nil // static, or not an ELF file: nothing to copy
	}
	sc := bufio.NewScanner(strings.NewReader(string(out)))
	for sc.Scan() {
		l := sc.Text()
		if !strings.HasPrefix(l, "\t") {
			continue
		}
		fs := strings.Fields(l)
		lib := ""
		switch {
		case len(fs) >= 3 && fs[1] == "=>":
			lib = fs[2]
		case len(fs) >= 1 && strings.HasPrefix(fs[0], "/"):
			lib = fs[0]
		}
		if lib == "" || !strings.HasPrefix(lib, "/") {
			continue // vdso
		}
		if err := f.copyOne(lib); err != nil {
			return err
		}
	}
	return nil
}

func (f *nsFlavor) copyOne(path string) error {
	dst := f.root + path
	if _, err := os.Stat(dst); err == nil {
		return nil
	}
	if err := os.MkdirAll(filepath.Dir(dst), 0o777); err != nil {
		return err
	}
	b, err := os.ReadFile(path)
	if err != nil {
		return err
	}
	st, err := os.Stat(path)
	if err != nil {
		return err
	}
	tmp := dst + ".tso"
	if err := os.WriteFile(tmp, b, st.Mode().Perm()); err != nil {
		return err
	}
	return os.Rename(tmp, dst)
}

// env is what zdtm.py sets for a test in the ns flavour.
func (f *nsFlavor) env() []string {
	env := []string{"ZDTM_NEWNS=1", "ZDTM_ROOT=" + f.root, "ZDTM_DEV=" + f.dev,
		"PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"}
	if f.userns {
		env = append(env, "ZDTM_USERNS=1")
	}
	return env
}

// dumpArgs and restoreArgs are zdtm.py's CRIU options of the flavour, plus
// the memory-file mount.
func (f *nsFlavor) dumpArgs() []string {
	return []string{"--root", f.root, "--external", "mnt[/dev]:ZDTM_DEV", "--external", "mnt[" + memMount + "]:LAZYFORK_MEM"}
}

func (f *nsFlavor) restoreArgs() []string {
	args := []string{"--root", f.root, "--external", "mnt[ZDTM_DEV]:" + f.dev, "--external", "mnt[LAZYFORK_MEM]:" + f.mem}
	if f.userns {
		// mount-v2 fails to mount the root from its user-namespace daemon
		// (mount of /proc/self/fd/N: EINVAL, CRIU 4.1.1 here).
		args = append(args, "--mntns-compat-mode")
	}
	return args
}

// nsPid is a process's pid in its own pid namespace (the last of NSpid).
func nsPid(pid int) int {
	if n, err := procfs.NSPID(pid); err == nil {
		return n
	}
	return pid
}
