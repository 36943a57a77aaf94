// Package criuproxy is the shim's side of the CRIU proxy: a small static C
// program (cmd/lazyfork-criu-proxy/proxy.c) installed as `criu` and `tar` in
// a directory of its own (criu-proxy/ beside the shim binaries), which the
// shim puts first on the PATH of its runc calls.
//
// runc asks CRIU for its version before every checkpoint and restore (a whole
// `criu swrk N` run: a CRIU start-up, 4-5 ms) and then runs `criu swrk 3`
// again for the real request. For `criu swrk N` the proxy peeks at the first
// request on fd N (nothing is consumed) and, if it is a VERSION request
// without keep_open, answers with the bytes the real CRIU answered the shim
// (EnvVersionAnswer) and exits 0 as CRIU does, provided the real CRIU
// (EnvReal) still has the identity the answer came from (EnvRealID, ID): an
// upgraded CRIU is asked again. runc's version check goes through go-criu,
// which gives CRIU the socketpair's own descriptor (never 3); runc's own
// requests come on fd 3, and `criu swrk 3` starts the real CRIU at once,
// unpeeked: a restore's request comes only after runc has put CRIU into the
// container's cgroups, and CRIU loads meanwhile. On another fd the proxy
// waits for the request only 5 ms (go-criu sends it at once).
//
// CRIU dumps each tmpfs mount of a container with `tar --create --gzip ...`
// (a tar and a gzip process, 4-6 ms, per mount and dump, inside the
// container's pause), and restores each with `tar --extract --gzip` (4-5 ms
// per mount and fork). Most hold nothing or only what runc puts into /dev
// (device nodes, symlinks, directories). Run as `tar` with exactly CRIU's
// create arguments on a tree of directories, symlinks, device nodes, fifos
// and small regular files, the proxy writes the archive GNU tar would (the
// same tar stream, byte for byte; gzipped in stored blocks) itself; with
// exactly CRIU's extract arguments and such an archive (stored blocks only,
// well-formed entries that stay inside the directory), it extracts it itself
// as GNU tar does as root. A real tar's archive, or anything unusual, goes to
// the real tar with standard input as it came.
//
// Anything else goes to the real program (EnvReal, EnvTarReal) with the same
// arguments, environment and file descriptors, so the worst case is today's
// behaviour plus one exec of a static binary (about 0.3 ms). It is C, not Go:
// Go's runtime start-up (1.5-2 ms) on every real CRIU and tar run would eat
// what the skipped runs save.
//
// Only root sets the shim's environment, so the proxy trusts it; the shim
// checks that everything it names is root-owned and writable by nobody else
// (TrustedPath), and keeps the real CRIU's answer across shims in a
// root-only cache (ReadCache, CacheName).
package criuproxy

import (
	"bytes"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"syscall"
)

// Environment the shim sets for its runc calls (runc, CRIU and tar inherit it).
const (
	// EnvReal is the absolute path of the real CRIU binary.
	EnvReal = "LAZYFORK_CRIU_REAL"
	// EnvRealID is EnvReal's identity (ID) when its answer was taken.
	EnvRealID = "LAZYFORK_CRIU_REAL_ID"
	// EnvVersionAnswer is the real CRIU's answer to a VERSION request, hex.
	EnvVersionAnswer = "LAZYFORK_CRIU_VERSION_ANSWER"
	// EnvTarReal is the absolute path of the real tar.
	EnvTarReal = "LAZYFORK_TAR_REAL"
	// EnvGate is the path prefix of dump gates: a `runc checkpoint` of
	// container ID waits, before CRIU starts, while a file EnvGate+ID exists
	// and is locked, and goes on only if it then holds "go".
	EnvGate = "LAZYFORK_CRIU_GATE"
)

// HasGate reports whether the proxy binary at path knows dump gates (it
// names EnvGate): an older proxy would let CRIU dump a container its shim
// is still moving.
func HasGate(path string) (bool, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return false, err
	}
	return bytes.Contains(b, []byte(EnvGate)), nil
}

// VersionSuffix ends the name of a version cache (CacheName).
const VersionSuffix = ".version"

// maxCache bounds a cached answer (the proxy holds 64 KiB; go-criu reads
// answers into 8 KiB).
const maxCache = 64 << 10

// ID is the identity of the file at path as the proxy compares it:
// "device:inode:size:mtime" (mtime in nanoseconds).
func ID(path string) (string, error) {
	var st syscall.Stat_t
	if err := syscall.Stat(path, &st); err != nil {
		return "", fmt.Errorf("stat %s: %w", path, err)
	}
	return fmt.Sprintf("%d:%d:%d:%d", st.Dev, st.Ino, st.Size, st.Mtim.Sec*1e9+st.Mtim.Nsec), nil
}

// CacheName names a cache of the CRIU binary at path on this boot, made of the
// binary's identity (device, inode, size, mtime) and the boot's id, so an
// upgraded CRIU or a reboot gets a new name. suffix ends it (".kdat",
// VersionSuffix).
func CacheName(criu, suffix string) (string, error) {
	var st syscall.Stat_t
	if err := syscall.Stat(criu, &st); err != nil {
		return "", fmt.Errorf("stat %s: %w", criu, err)
	}
	boot, err := os.ReadFile("/proc/sys/kernel/random/boot_id")
	if err != nil {
		return "", err
	}
	id := fmt.Sprintf("%s %d %d %d %d.%d %s", criu, st.Dev, st.Ino, st.Size,
		st.Mtim.Sec, st.Mtim.Nsec, strings.TrimSpace(string(boot)))
	sum := sha256.Sum256([]byte(id))
	return "criu-" + hex.EncodeToString(sum[:8]) + suffix, nil
}

// Trusted says whether st is owned by uid and writable by nobody else (no
// group or other write bit).
func Trusted(st *syscall.Stat_t, uid uint32) error {
	if st.Uid != uid {
		return fmt.Errorf("owned by uid %d, not %d", st.Uid, uid)
	}
	if st.Mode&0o022 != 0 {
		return fmt.Errorf("mode %#o: writable by group or others", st.Mode&0o7777)
	}
	return nil
}

// TrustedPath checks path (following links) is a regular file or a directory
// (as dir says) that Trusted accepts for uid.
func TrustedPath(path string, dir bool, uid uint32) error {
	var st syscall.Stat_t
	if err := syscall.Stat(path, &st); err != nil {
		return fmt.Errorf("stat %s: %w", path, err)
	}
	want, kind := uint32(syscall.S_IFREG), "regular file"
	if dir {
		want, kind = syscall.S_IFDIR, "directory"
	}
	if st.Mode&syscall.S_IFMT != want {
		return fmt.Errorf("%s: not a %s", path, kind)
	}
	if err := Trusted(&st, uid); err != nil {
		return fmt.Errorf("%s: %w", path, err)
	}
	return nil
}

// ReadCache reads the version cache of the CRIU binary criu in dir, if dir is
// a directory and the cache a regular file, both owned by uid and writable by
// nobody else; the file is opened without following a link.
func ReadCache(dir, criu string, uid uint32) ([]byte, error) {
	var st syscall.Stat_t
	if err := syscall.Lstat(dir, &st); err != nil {
		return nil, fmt.Errorf("stat %s: %w", dir, err)
	}
	if st.Mode&syscall.S_IFMT != syscall.S_IFDIR {
		return nil, fmt.Errorf("%s: not a directory", dir)
	}
	if err := Trusted(&st, uid); err != nil {
		return nil, fmt.Errorf("%s: %w", dir, err)
	}
	name, err := CacheName(criu, VersionSuffix)
	if err != nil {
		return nil, err
	}
	path := filepath.Join(dir, name)
	f, err := os.OpenFile(path, os.O_RDONLY|syscall.O_NOFOLLOW, 0)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	fi, err := f.Stat()
	if err != nil {
		return nil, err
	}
	if !fi.Mode().IsRegular() {
		return nil, fmt.Errorf("%s: not a regular file", path)
	}
	if err := Trusted(fi.Sys().(*syscall.Stat_t), uid); err != nil {
		return nil, fmt.Errorf("%s: %w", path, err)
	}
	if fi.Size() <= 0 || fi.Size() > maxCache {
		return nil, fmt.Errorf("%s: %d bytes", path, fi.Size())
	}
	b := make([]byte, fi.Size())
	if n, err := f.Read(b); err != nil || n != len(b) {
		return nil, fmt.Errorf("read %s: %d of %d bytes: %v", path, n, len(b), err)
	}
	return b, nil
}

// Source is the proxy's C source in this source tree (for tests).
func Source() string {
	_, file, _, _ := runtime.Caller(0)
	return filepath.Join(filepath.Dir(file), "..", "..", "cmd", "lazyfork-criu-proxy", "proxy.c")
}

// Build compiles the proxy as make build does (gcc -static -O2 -s) into dir
// as criu and links it as tar there; for tests, in this source tree.
// flags are added (-DLAZYFORK_PROXY_TEST builds the decoder's test driver).
func Build(dir string, flags ...string) (criu string, err error) {
	criu = filepath.Join(dir, "criu")
	args := append([]string{"-static", "-O2", "-s", "-Wall", "-Werror", "-o", criu}, flags...)
	if out, err := exec.Command("gcc", append(args, Source())...).CombinedOutput(); err != nil {
		return "", fmt.Errorf("gcc %s: %w: %s (install build-essential)", Source(), err, out)
	}
	if err := os.Link(criu, filepath.Join(dir, "tar")); err != nil {
		return "", err
	}
	return criu, nil
}
