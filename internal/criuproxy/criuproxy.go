// Package criuproxy answers runc's CRIU version checks from a cache.
//
// runc asks CRIU for its version before every checkpoint and restore (a whole
// `criu swrk N` run: a CRIU start-up, 4-5 ms) and then runs `criu swrk 3` again
// for the real request. Both find "criu" on PATH. The LazyFork shim puts a
// directory holding this proxy, named criu, first on the PATH of its runc
// calls. For `criu swrk N` the proxy peeks at the first request on fd N (an
// AF_UNIX SOCK_SEQPACKET socket; nothing is consumed) and, if it is a VERSION
// request, answers with the bytes the real CRIU answered the shim (the cache,
// made by the shim once per CRIU binary and boot) and exits 0 as CRIU does.
// Any other request, any other command line, a missing or untrusted cache, or
// any error: it executes the real CRIU with the same arguments, environment
// and file descriptors, so the worst case is today's behaviour plus one small
// exec.
//
// The shim tells the proxy the real CRIU (EnvReal) and the cache directory
// (EnvCacheDir). Both must be root-owned and writable by nobody else: the
// proxy answers from a cache only then, and only if the cache's name matches
// the real binary's identity now (CacheName: device, inode, size, mtime, and
// the boot), so an upgraded CRIU is asked again.
//
// This package is imported by the proxy: standard library only, so its
// start-up stays small.
package criuproxy

import (
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
)

// Environment the shim sets for its runc calls (runc and CRIU inherit it).
const (
	// EnvReal is the absolute path of the real CRIU binary.
	EnvReal = "LAZYFORK_CRIU_REAL"
	// EnvCacheDir is the root-only directory holding the version caches.
	EnvCacheDir = "LAZYFORK_CRIU_CACHE_DIR"
)

// VersionSuffix ends the name of a version cache (CacheName).
const VersionSuffix = ".version"

// CRIU's request types and fields this package reads (images/rpc.proto:
// criu_req_type, criu_req). The unit tests hold them to go-criu's rpc package.
const (
	ReqVersion = 10 // CRIU_REQ_TYPE__VERSION

	fieldType     = 1 // criu_req.type
	fieldKeepOpen = 4 // criu_req.keep_open
)

// maxRequest bounds the requests the proxy reads (CRIU's are a few KiB at most).
const maxRequest = 1 << 20

// maxCache bounds a cached answer (go-criu reads answers into 8 KiB).
const maxCache = 64 << 10

// Request is what the proxy reads of a criu_req.
type Request struct {
	Type     uint64 // criu_req.type
	HasType  bool   // the message holds a type (it is required)
	KeepOpen bool   // criu_req.keep_open: more requests follow on the socket
}

// ParseRequest decodes the top-level fields of a marshalled criu_req that the
// proxy needs, skipping the others. Protobuf's rule holds: of a field given
// twice, the last counts.
func ParseRequest(b []byte) (Request, error) {
	var r Request
	for len(b) > 0 {
		key, n := uvarint(b)
		if n <= 0 {
			return Request{}, errors.New("criu request: bad field key")
		}
		b = b[n:]
		field, wire := key>>3, key&7
		if field == 0 {
			return Request{}, errors.New("criu request: field number 0")
		}
		switch wire {
		case 0: // varint
			v, n := uvarint(b)
			if n <= 0 {
				return Request{}, fmt.Errorf("criu request: bad varint in field %d", field)
			}
			b = b[n:]
			switch field {
			case fieldType:
				r.Type, r.HasType = v, true
			case fieldKeepOpen:
				r.KeepOpen = v != 0
			}
		case 1: // 64-bit
			if len(b) < 8 {
				return Request{}, fmt.Errorf("criu request: field %d truncated", field)
			}
			b = b[8:]
		case 2: // length-delimited
			l, n := uvarint(b)
			if n <= 0 || l > uint64(len(b)-n) {
				return Request{}, fmt.Errorf("criu request: field %d truncated", field)
			}
			b = b[n+int(l):]
		case 5: // 32-bit
			if len(b) < 4 {
				return Request{}, fmt.Errorf("criu request: field %d truncated", field)
			}
			b = b[4:]
		default:
			return Request{}, fmt.Errorf("criu request: wire type %d in field %d", wire, field)
		}
		if (field == fieldType || field == fieldKeepOpen) && wire != 0 {
			return Request{}, fmt.Errorf("criu request: field %d has wire type %d", field, wire)
		}
	}
	if !r.HasType {
		return Request{}, errors.New("criu request: no type")
	}
	return r, nil
}

// uvarint decodes a protobuf varint: the value and its length, or n <= 0.
func uvarint(b []byte) (v uint64, n int) {
	for i := 0; i < len(b) && i < 10; i++ {
		c := b[i]
		if i == 9 && c > 1 {
			return 0, -1
		}
		v |= uint64(c&0x7f) << (7 * i)
		if c < 0x80 {
			return v, i + 1
		}
	}
	return 0, -1
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
	want := uint32(syscall.S_IFREG)
	if dir {
		want = syscall.S_IFDIR
	}
	if st.Mode&syscall.S_IFMT != want {
		return fmt.Errorf("%s: not a %s", path, map[bool]string{false: "regular file", true: "directory"}[dir])
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
	fd, err := openNoFollow(path)
	if err != nil {
		return nil, err
	}
	defer syscall.Close(fd)
	if err := syscall.Fstat(fd, &st); err != nil {
		return nil, fmt.Errorf("stat %s: %w", path, err)
	}
	if st.Mode&syscall.S_IFMT != syscall.S_IFREG {
		return nil, fmt.Errorf("%s: not a regular file", path)
	}
	if err := Trusted(&st, uid); err != nil {
		return nil, fmt.Errorf("%s: %w", path, err)
	}
	if st.Size <= 0 || st.Size > maxCache {
		return nil, fmt.Errorf("%s: %d bytes", path, st.Size)
	}
	b := make([]byte, st.Size)
	n, err := readFull(fd, b)
	if err != nil || n != len(b) {
		return nil, fmt.Errorf("read %s: %d of %d bytes: %v", path, n, len(b), err)
	}
	return b, nil
}

func openNoFollow(path string) (int, error) {
	for {
		fd, err := syscall.Open(path, syscall.O_RDONLY|syscall.O_NOFOLLOW|syscall.O_CLOEXEC, 0)
		if err == syscall.EINTR {
			continue
		}
		if err != nil {
			return -1, fmt.Errorf("open %s: %w", path, err)
		}
		return fd, nil
	}
}

func readFull(fd int, b []byte) (int, error) {
	n := 0
	for n < len(b) {
		m, err := syscall.Read(fd, b[n:])
		if err == syscall.EINTR {
			continue
		}
		if err != nil {
			return n, err
		}
		if m == 0 {
			break
		}
		n += m
	}
	return n, nil
}

// swrkFD is the socket of a `criu swrk N` command line (args as os.Args),
// or -1 for any other command line. CRIU takes exactly `swrk <fd>`.
func swrkFD(args []string) int {
	if len(args) != 3 || args[1] != "swrk" {
		return -1
	}
	fd, err := strconv.Atoi(args[2])
	if err != nil || fd < 0 || strconv.Itoa(fd) != args[2] {
		return -1
	}
	return fd
}

// Serve answers a VERSION request on the socket of a `criu swrk N` command
// line from the cache in cacheDir of the real CRIU real. It reports whether
// it consumed the request (then the proxy exits: 0 if err is nil, as CRIU
// does after answering); when it did not, the real CRIU must run and finds
// the request unread.
func Serve(args []string, real, cacheDir string, uid uint32) (served bool, err error) {
	fd := swrkFD(args)
	if fd < 0 || cacheDir == "" {
		return false, nil
	}
	if t, err := syscall.GetsockoptInt(fd, syscall.SOL_SOCKET, syscall.SO_TYPE); err != nil || t != syscall.SOCK_SEQPACKET {
		return false, nil
	}
	if d, err := syscall.GetsockoptInt(fd, syscall.SOL_SOCKET, syscall.SO_DOMAIN); err != nil || d != syscall.AF_UNIX {
		return false, nil
	}
	// The request's length, as CRIU reads it (MSG_TRUNC reports the whole).
	n, err := recv(fd, nil, syscall.MSG_PEEK|syscall.MSG_TRUNC)
	if err != nil || n <= 0 || n > maxRequest {
		return false, nil
	}
	buf := make([]byte, n)
	if m, err := recv(fd, buf, syscall.MSG_PEEK); err != nil || m != n {
		return false, nil
	}
	req, err := ParseRequest(buf)
	if err != nil || req.Type != ReqVersion || req.KeepOpen {
		return false, nil
	}
	resp, err := ReadCache(cacheDir, real, uid)
	if err != nil {
		return false, nil
	}
	// From here on the request is ours.
	if m, err := recv(fd, buf, syscall.MSG_TRUNC); err != nil || m != n {
		return true, fmt.Errorf("read the version request on fd %d: %d bytes, %v", fd, m, err)
	}
	for {
		m, err := syscall.Write(fd, resp)
		if err == syscall.EINTR {
			continue
		}
		if err != nil || m != len(resp) {
			return true, fmt.Errorf("answer the version request on fd %d: %d of %d bytes, %v", fd, m, len(resp), err)
		}
		return true, nil
	}
}

// recv is recvfrom(2) again after EINTR (Go's runtime preempts threads with
// signals).
func recv(fd int, b []byte, flags int) (int, error) {
	for {
		n, _, err := syscall.Recvfrom(fd, b, flags)
		if err == syscall.EINTR {
			continue
		}
		return n, err
	}
}

// Real is the CRIU to run: EnvReal when it is an absolute path to a regular
// file owned by root and writable by nobody else, and not this proxy
// (trusted: a cache may answer for it); otherwise the first criu on PATH that
// is not this proxy (as runc would have found without it; not trusted).
func Real(self string) (path string, trusted bool) {
	var me syscall.Stat_t
	haveSelf := syscall.Stat(self, &me) == nil
	isSelf := func(p string) bool {
		var st syscall.Stat_t
		return haveSelf && syscall.Stat(p, &st) == nil && st.Dev == me.Dev && st.Ino == me.Ino
	}
	if p := os.Getenv(EnvReal); filepath.IsAbs(p) && !isSelf(p) && TrustedPath(p, false, 0) == nil {
		return p, true
	}
	for _, dir := range filepath.SplitList(os.Getenv("PATH")) {
		if !filepath.IsAbs(dir) {
			continue
		}
		p := filepath.Join(dir, "criu")
		var st syscall.Stat_t
		if syscall.Stat(p, &st) != nil || st.Mode&syscall.S_IFMT != syscall.S_IFREG || st.Mode&0o111 == 0 || isSelf(p) {
			continue
		}
		return p, false
	}
	return "", false
}

// Main is the proxy's main function.
func Main() {
	self, err := os.Executable()
	if err != nil {
		self = "/proc/self/exe"
	}
	real, trusted := Real(self)
	if real == "" {
		fmt.Fprintf(os.Stderr, "lazyfork criu proxy (%s): no criu on PATH but this proxy; set %s to the real CRIU or turn the proxy off (LAZYFORK_CRIU_PROXY=off in the shim's environment)\n", self, EnvReal)
		os.Exit(1)
	}
	if trusted {
		served, err := Serve(os.Args, real, os.Getenv(EnvCacheDir), 0)
		if served {
			if err != nil {
				fmt.Fprintf(os.Stderr, "lazyfork criu proxy: %v\n", err)
				os.Exit(1)
			}
			os.Exit(0)
		}
	}
	err = syscall.Exec(real, os.Args, os.Environ())
	fmt.Fprintf(os.Stderr, "lazyfork criu proxy: exec %s: %v\n", real, err)
	os.Exit(127)
}
