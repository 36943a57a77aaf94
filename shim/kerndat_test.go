package shim

import (
	"bytes"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/lazyfork/lazyfork/internal/hwbreak"
	"github.com/lazyfork/lazyfork/internal/testutil"
)

// TestMain lets the test binary stand in for the shim binary as the
// kerndat helper (RunHook), as the shim re-executes itself.
func TestMain(m *testing.M) {
	if len(os.Args) > 2 && os.Args[1] == HookArg && (os.Args[2] == kerndatHelperArg || os.Args[2] == hwbreakHelperArg) {
		os.Exit(RunHook(os.Args[2:]))
	}
	os.Exit(m.Run())
}

// kerndatNSEnv marks the test binary re-run in a private mount namespace.
const kerndatNSEnv = "LAZYFORK_TEST_KERNDAT_NS"

// inPrivateMountNS runs the named test again, alone, in a new mount namespace
// (whose mounts Go makes private: nothing it mounts reaches the host) and
// fails t with its output if it fails. It reports false when the caller is
// that run and should do the work.
func inPrivateMountNS(t *testing.T, name string) bool {
	t.Helper()
	if os.Getenv(kerndatNSEnv) == name {
		return false
	}
	cmd := exec.Command(os.Args[0], "-test.run=^"+name+"$", "-test.v", "-test.count=1")
	cmd.Env = append(os.Environ(), kerndatNSEnv+"="+name)
	cmd.SysProcAttr = &syscall.SysProcAttr{Unshareflags: syscall.CLONE_NEWNS}
	out, err := cmd.CombinedOutput()
	if err != nil || !bytes.Contains(out, []byte("--- PASS: "+name)) || bytes.Contains(out, []byte("--- SKIP: "+name)) {
		if bytes.Contains(out, []byte("--- SKIP: "+name)) && err == nil {
			t.Skipf("in a private mount namespace:\n%s", out)
		}
		t.Fatalf("in a private mount namespace: %v\n%s", err, out)
	}
	return true
}

// privateRunOnDisk, in the test's own mount namespace, puts a directory of a
// disk over /run (this host's case: CRIU keeps no cache there) and a fresh
// tmpfs under kerndatDir's parent, so neither the host's /run nor its
// /dev/shm is touched.
func privateRunOnDisk(t *testing.T) {
	t.Helper()
	disk := ""
	for _, base := range []string{os.TempDir(), "/var/tmp"} {
		if tmpfs, err := isTmpfs(base); err == nil && !tmpfs {
			disk = base
			break
		}
	}
	if disk == "" {
		t.Skip("no directory on a disk to stand for a /run without tmpfs")
	}
	run, err := os.MkdirTemp(disk, "lazyfork-kdat-run-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(run) })
	if err := unix.Mount(run, "/run", "", unix.MS_BIND, ""); err != nil {
		t.Fatalf("bind a disk directory over /run: %v", err)
	}
	t.Cleanup(func() { unix.Unmount("/run", unix.MNT_DETACH) })
	shm := t.TempDir()
	if err := unix.Mount("lazyfork-kdat-test", shm, "tmpfs", 0, "mode=1777,size=1m"); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { unix.Unmount(shm, unix.MNT_DETACH) })
	old := kerndatDir
	kerndatDir = filepath.Join(shm, "lazyfork-criu")
	t.Cleanup(func() { kerndatDir = old })
}

// criuLoadsCache runs a CRIU command and reports whether it loaded its
// kernel-feature cache from /run/criu.kdat.
func criuLoadsCache(t *testing.T) bool {
	t.Helper()
	logf := filepath.Join(t.TempDir(), "check.log")
	out, err := exec.Command("criu", "check", "--feature", "mnt_id", "-v4", "-o", logf).CombinedOutput()
	if err != nil {
		t.Fatalf("criu check: %v: %s", err, out)
	}
	b, err := os.ReadFile(logf)
	if err != nil {
		t.Fatal(err)
	}
	return strings.Contains(string(b), "Loaded kdat cache from /run/criu.kdat")
}

// TestKerndatCache: on a host whose /run is on a disk, CRIU (run as runc runs
// it) loads the cache the shim made, through a link to a file outside any
// LazyFork root; someone else's regular /run/criu.kdat is left alone, and a
// dangling link (the cache gone at a reboot) or a link to another CRIU
// binary's cache is replaced.
func TestKerndatCache(t *testing.T) {
	testutil.RequiresCRIU(t)
	if inPrivateMountNS(t, "TestKerndatCache") {
		return
	}
	privateRunOnDisk(t)
	if criuLoadsCache(t) {
		t.Fatal("CRIU loaded a cache before the shim made one")
	}
	self, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	criu, err := exec.LookPath("criu")
	if err != nil {
		t.Fatal(err)
	}

	if err := ensureKerndatCache(self, criu); err != nil {
		t.Fatal(err)
	}
	target, err := os.Readlink(kerndatLink)
	if err != nil {
		t.Fatalf("no link at %s: %v", kerndatLink, err)
	}
	if filepath.Dir(target) != kerndatDir {
		t.Fatalf("link points at %s, want a file in %s", target, kerndatDir)
	}
	if !criuLoadsCache(t) {
		t.Fatal("CRIU did not load the cache through the link")
	}
	b, err := os.ReadFile(target)
	if err != nil {
		t.Fatal(err)
	}

	// A reboot emptied the directory: the dangling link is replaced.
	if err := os.Remove(target); err != nil {
		t.Fatal(err)
	}
	if criuLoadsCache(t) {
		t.Fatal("CRIU loaded a cache through a dangling link")
	}
	if err := ensureKerndatCache(self, criu); err != nil {
		t.Fatal(err)
	}
	if b2, err := os.ReadFile(kerndatLink); err != nil || len(b2) != len(b) {
		t.Fatalf("new cache: %d bytes, %v (first was %d)", len(b2), err, len(b))
	}

	// Another binary's cache (an upgraded CRIU): the link is re-pointed.
	other := filepath.Join(kerndatDir, "criu-0000000000000000.kdat")
	if err := os.WriteFile(other, []byte("another build"), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.Remove(kerndatLink); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink(other, kerndatLink); err != nil {
		t.Fatal(err)
	}
	if err := ensureKerndatCache(self, criu); err != nil {
		t.Fatal(err)
	}
	if got, _ := os.Readlink(kerndatLink); got != target {
		t.Fatalf("link points at %q, want %s", got, target)
	}

	// Someone else's regular file is theirs.
	if err := os.Remove(kerndatLink); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(kerndatLink, []byte("theirs"), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := ensureKerndatCache(self, criu); err != nil {
		t.Fatal(err)
	}
	if b, _ := os.ReadFile(kerndatLink); string(b) != "theirs" {
		t.Fatalf("a regular %s was replaced", kerndatLink)
	}
}

// TestKerndatDirTrusted: CRIU trusts the cache (vDSO offsets among others),
// so the shim refuses a cache directory someone else could write, and links
// nothing.
func TestKerndatDirTrusted(t *testing.T) {
	testutil.RequiresRoot(t)
	if inPrivateMountNS(t, "TestKerndatDirTrusted") {
		return
	}
	privateRunOnDisk(t)
	if err := os.Mkdir(kerndatDir, 0o777); err != nil {
		t.Fatal(err)
	}
	if err := os.Chmod(kerndatDir, 0o777); err != nil {
		t.Fatal(err)
	}
	if err := ensureKerndatDir(kerndatDir); err == nil {
		t.Fatalf("a world-writable %s was accepted", kerndatDir)
	}
	if err := os.Remove(kerndatDir); err != nil {
		t.Fatal(err)
	}
	elsewhere := t.TempDir()
	if err := os.Symlink(elsewhere, kerndatDir); err != nil {
		t.Fatal(err)
	}
	if err := ensureKerndatDir(kerndatDir); err == nil {
		t.Fatalf("a link at %s was accepted", kerndatDir)
	}
	if err := os.Remove(kerndatDir); err != nil {
		t.Fatal(err)
	}
	if err := ensureKerndatDir(kerndatDir); err != nil {
		t.Fatal(err)
	}
	fi, err := os.Lstat(kerndatDir)
	if err != nil || !fi.IsDir() || fi.Mode().Perm() != 0o700 {
		t.Fatalf("made %s: %v, %v", kerndatDir, fi.Mode(), err)
	}
}

// TestKerndatDirSquatted: another user who makes kerndatDir first (in the
// world-writable /dev/shm), or a link there, takes nothing from the shims:
// the caches go to a root-only directory of a random name beside it, which
// the next shims find through a record only root can write, and CRIU loads
// its cache from there. The squatter's directory is neither used nor
// touched; a record naming someone else's directory is not followed.
func TestKerndatDirSquatted(t *testing.T) {
	criu := testutil.RequiresCRIU(t)
	if inPrivateMountNS(t, "TestKerndatDirSquatted") {
		return
	}
	privateRunOnDisk(t)
	self, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	theirs := filepath.Join(filepath.Dir(kerndatDir), "theirs")
	for _, squat := range []struct {
		name string
		make func() error
	}{
		{"a directory of another user", func() error {
			if err := os.Mkdir(kerndatDir, 0o755); err != nil {
				return err
			}
			return os.Chown(kerndatDir, 65534, 65534)
		}},
		{"a link to another user's directory", func() error { return os.Symlink(theirs, kerndatDir) }},
		{"a file", func() error { return os.WriteFile(kerndatDir, nil, 0o644) }},
	} {
		t.Run(squat.name, func(t *testing.T) {
			if err := os.Mkdir(theirs, 0o755); err != nil {
				t.Fatal(err)
			}
			if err := os.Chown(theirs, 65534, 65534); err != nil {
				t.Fatal(err)
			}
			if err := squat.make(); err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() {
				os.Remove(kerndatLink)
				os.Remove(kerndatDirRecord())
				matches, _ := filepath.Glob(kerndatDir + "*")
				for _, m := range append(matches, theirs) {
					os.RemoveAll(m)
				}
			})

			dir, err := criuCacheDir()
			if err != nil {
				t.Fatalf("with %s at %s: %v", squat.name, kerndatDir, err)
			}
			if dir == kerndatDir || filepath.Dir(dir) != filepath.Dir(kerndatDir) {
				t.Fatalf("cache directory %s, want a new one beside %s", dir, kerndatDir)
			}
			fi, err := os.Lstat(dir)
			if err != nil || !fi.IsDir() || fi.Mode().Perm() != 0o700 || fi.Sys().(*syscall.Stat_t).Uid != 0 {
				t.Fatalf("%s: %v %v", dir, fi.Mode(), err)
			}
			if again, err := criuCacheDir(); err != nil || again != dir {
				t.Fatalf("second shim: %q, %v; want the recorded %s", again, err, dir)
			}
			if err := ensureKerndatCache(self, criu); err != nil {
				t.Fatal(err)
			}
			if target, err := os.Readlink(kerndatLink); err != nil || filepath.Dir(target) != dir {
				t.Fatalf("%s links to %q (%v), want a file in %s", kerndatLink, target, err, dir)
			}
			if !criuLoadsCache(t) {
				t.Fatal("CRIU did not load the cache")
			}
			if ents, err := os.ReadDir(theirs); err != nil || len(ents) != 0 {
				t.Fatalf("the squatter's directory: %v %v", ents, err)
			}

			// A record naming someone else's directory is not followed.
			if err := os.WriteFile(kerndatDirRecord(), []byte(filepath.Join(filepath.Dir(kerndatDir), "lazyfork-criu-x")+"\n"), 0o600); err != nil {
				t.Fatal(err)
			}
			if err := os.Rename(theirs, filepath.Join(filepath.Dir(kerndatDir), "lazyfork-criu-x")); err != nil {
				t.Fatal(err)
			}
			other, err := criuCacheDir()
			if err != nil {
				t.Fatal(err)
			}
			if fi, err := os.Lstat(other); other == filepath.Join(filepath.Dir(kerndatDir), "lazyfork-criu-x") || err != nil || fi.Sys().(*syscall.Stat_t).Uid != 0 {
				t.Fatalf("followed a record to %s (%v)", other, err)
			}
			os.Rename(filepath.Join(filepath.Dir(kerndatDir), "lazyfork-criu-x"), theirs)
		})
	}
}

// The shim learns from its helper (never in its own process, whose reaper
// would take the probe's wait) whether the host's breakpoints trap, keeps the
// answer for the boot, and runs CRIU with CRIU_FAULT=130 where they do not;
// a CRIU_FAULT of the environment's own stays.
func TestSetCRIUBreakpoints(t *testing.T) {
	testutil.RequiresRoot(t)
	ok, err := hwbreak.Probe()
	if err != nil {
		t.Fatal(err)
	}
	shm, err := os.MkdirTemp("/dev/shm", "lazyfork-hwbreak-test-") // a tmpfs, as the cache needs
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(shm) })
	old := kerndatDir
	kerndatDir = filepath.Join(shm, "lazyfork-criu")
	t.Cleanup(func() { kerndatDir = old })
	t.Setenv(hwbreak.CRIUFault, "")
	os.Unsetenv(hwbreak.CRIUFault)
	set, err := setCRIUBreakpoints(os.Args[0])
	if err != nil {
		t.Fatal(err)
	}
	if set != !ok || (os.Getenv(hwbreak.CRIUFault) == hwbreak.NoBreakpoints) != !ok {
		t.Errorf("breakpoints work: %v; the shim set CRIU_FAULT: %v (%q)", ok, set, os.Getenv(hwbreak.CRIUFault))
	}
	cached, err := os.ReadFile(filepath.Join(kerndatDir, hwbreakCacheName))
	if want := map[bool]string{true: "ok\n", false: "broken\n"}[ok]; err != nil || string(cached) != want {
		t.Errorf("cached answer %q (%v), want %q", cached, err, want)
	}
	// The answer is read back, not probed again.
	os.Unsetenv(hwbreak.CRIUFault)
	if err := os.WriteFile(filepath.Join(kerndatDir, hwbreakCacheName), []byte("broken\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	if set, err := setCRIUBreakpoints("/nonexistent"); err != nil || !set || os.Getenv(hwbreak.CRIUFault) != hwbreak.NoBreakpoints {
		t.Errorf("from a cached \"broken\": set %v, %v, CRIU_FAULT=%q", set, err, os.Getenv(hwbreak.CRIUFault))
	}
	// A helper that gives no answer: CRIU without breakpoints, said.
	os.Unsetenv(hwbreak.CRIUFault)
	os.Remove(filepath.Join(kerndatDir, hwbreakCacheName))
	if set, err := setCRIUBreakpoints("/nonexistent"); err == nil || !set || os.Getenv(hwbreak.CRIUFault) != hwbreak.NoBreakpoints {
		t.Errorf("no answer: set %v, %v, CRIU_FAULT=%q; want set, and the error", set, err, os.Getenv(hwbreak.CRIUFault))
	}
	os.Setenv(hwbreak.CRIUFault, "1")
	if set, _ := setCRIUBreakpoints("/nonexistent"); set || os.Getenv(hwbreak.CRIUFault) != "1" {
		t.Errorf("the environment's CRIU_FAULT=1 was replaced")
	}
}
