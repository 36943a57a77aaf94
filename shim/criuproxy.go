package shim

import (
	"bytes"
	"context"
	"encoding/hex"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"time"

	"github.com/checkpoint-restore/go-criu/v7/rpc"
	"golang.org/x/sys/unix"
	"google.golang.org/protobuf/proto"

	"github.com/lazyfork/lazyfork/internal/criuproxy"
)

// runc asks CRIU for its version before every checkpoint and restore, a
// whole `criu swrk` run (a CRIU start-up, 4-5 ms), and runs CRIU again for
// the request itself; and CRIU dumps every tmpfs mount of a container with a
// tar and a gzip process (4-6 ms each, inside the container's pause), most of
// them empty. The shim puts criuProxyDir (beside this binary: the proxy,
// cmd/lazyfork-criu-proxy/proxy.c, installed as `criu` and `tar`) first on its
// own PATH, which runc, CRIU and tar inherit, and tells the proxy the real
// CRIU, its identity and its answer to a VERSION request, and the real tar,
// in the environment (internal/criuproxy). The answer is asked once per CRIU
// binary and boot and kept beside the kernel-feature cache (criuCacheDir).
// The proxy answers version requests and CRIU's tar of an empty directory,
// and executes the real program for everything else. criuProxyEnv=off leaves
// runc's PATH alone.

// criuProxyEnv turns the proxy off ("off").
const criuProxyEnv = "LAZYFORK_CRIU_PROXY"

// criuProxyDir is the proxy's directory beside the shim binary self.
func criuProxyDir(self string) string {
	return filepath.Join(filepath.Dir(self), "criu-proxy")
}

// realCRIU is the first criu on PATH that is not in the proxy's directory
// (the CRIU runc would run without the proxy).
func realCRIU(self string) (string, error) {
	return lookPathBut(self, "criu", "install CRIU (make deps)")
}

// lookPathBut is the first executable name on PATH outside the proxy's
// directory; hint says what to do when there is none.
func lookPathBut(self, name, hint string) (string, error) {
	skip := criuProxyDir(self)
	// Not the proxy itself under another path either: it would execute
	// itself for ever.
	proxy, _ := os.Stat(filepath.Join(skip, name))
	for _, dir := range filepath.SplitList(os.Getenv("PATH")) {
		if !filepath.IsAbs(dir) || filepath.Clean(dir) == skip {
			continue
		}
		p := filepath.Join(dir, name)
		if fi, err := os.Stat(p); err == nil && fi.Mode().IsRegular() && fi.Mode()&0o111 != 0 && (proxy == nil || !os.SameFile(fi, proxy)) {
			return p, nil
		}
	}
	return "", fmt.Errorf("no %s on PATH (%s): %s", name, os.Getenv("PATH"), hint)
}

// setupCRIUProxy asks the CRIU binary criu for its version if no cache holds
// its answer, and puts the proxy first on PATH with the environment it reads.
// The proxy (as criu and tar), its directory, criu and the real tar must be
// root-owned and writable by nobody else (runc runs them as root). gateErr
// says why the proxy runs without dump gates (dumpgate.go).
func setupCRIUProxy(self, criu string) (gateErr, err error) {
	dir := criuProxyDir(self)
	tar, err := lookPathBut(self, "tar", "install tar")
	if err != nil {
		return nil, err
	}
	uid := uint32(os.Geteuid())
	for _, c := range []struct {
		path string
		dir  bool
	}{{dir, true}, {filepath.Join(dir, "criu"), false}, {filepath.Join(dir, "tar"), false}, {criu, false}, {tar, false}} {
		if err := criuproxy.TrustedPath(c.path, c.dir, uid); err != nil {
			return nil, fmt.Errorf("%w: the proxy is off (reinstall with make install)", err)
		}
	}
	id, err := criuproxy.ID(criu)
	if err != nil {
		return nil, err
	}
	cacheDir, err := criuCacheDir()
	if err != nil {
		return nil, err
	}
	answer, err := criuproxy.ReadCache(cacheDir, criu, uid)
	if err != nil {
		name, err := criuproxy.CacheName(criu, criuproxy.VersionSuffix)
		if err != nil {
			return nil, err
		}
		if answer, err = askCRIUVersion(criu); err != nil {
			return nil, err
		}
		if err := writeFileAtomic(filepath.Join(cacheDir, name), answer, 0o600); err != nil {
			return nil, err
		}
	}
	path := []string{dir}
	for _, d := range filepath.SplitList(os.Getenv("PATH")) {
		if d != dir {
			path = append(path, d)
		}
	}
	prefix, gateErr := setupGates(cacheDir, filepath.Join(dir, "criu"))
	// PATH last: a runc started meanwhile finds the proxy only once the
	// proxy has what it reads.
	for _, kv := range [][2]string{
		{criuproxy.EnvReal, criu},
		{criuproxy.EnvRealID, id},
		{criuproxy.EnvVersionAnswer, hex.EncodeToString(answer)},
		{criuproxy.EnvTarReal, tar},
		{criuproxy.EnvGate, prefix},
		{"PATH", strings.Join(path, string(filepath.ListSeparator))},
	} {
		if err := os.Setenv(kv[0], kv[1]); err != nil {
			return nil, err
		}
	}
	gatePrefix.Store(prefix)
	return gateErr, nil
}

// askCRIUVersion sends CRIU a VERSION request, as go-criu does for runc
// (`criu swrk N`, one request on an AF_UNIX SOCK_SEQPACKET socket), and
// returns its answer as it came.
func askCRIUVersion(criu string) ([]byte, error) {
	fds, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_SEQPACKET|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return nil, fmt.Errorf("socketpair for criu swrk: %w", err)
	}
	cln := os.NewFile(uintptr(fds[0]), "criu-client")
	srv := os.NewFile(uintptr(fds[1]), "criu-server")
	defer cln.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	cmd := exec.CommandContext(ctx, criu, "swrk", "3")
	cmd.ExtraFiles = []*os.File{srv}
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	err = cmd.Start()
	srv.Close()
	if err != nil {
		return nil, fmt.Errorf("run %s swrk: %w", criu, err)
	}
	req, err := proto.Marshal(&rpc.CriuReq{Type: rpc.CriuReqType_VERSION.Enum()})
	if err != nil {
		return nil, err
	}
	resp := make([]byte, 64<<10)
	n := 0
	if _, err = cln.Write(req); err == nil {
		n, err = cln.Read(resp) // a killed CRIU closes its end: EOF
	}
	cln.Close()
	if werr := cmd.Wait(); werr != nil && !reapedElsewhere(werr) {
		err = errors.Join(err, werr)
	}
	if err != nil {
		return nil, fmt.Errorf("ask %s for its version: %w: %s", criu, err, bytes.TrimSpace(stderr.Bytes()))
	}
	resp = resp[:n]
	var r rpc.CriuResp
	if err := proto.Unmarshal(resp, &r); err != nil {
		return nil, fmt.Errorf("%s's version answer: %w", criu, err)
	}
	if r.GetType() != rpc.CriuReqType_VERSION || !r.GetSuccess() || r.GetVersion().GetMajorNumber() == 0 {
		return nil, fmt.Errorf("%s's version answer is no version: %v", criu, &r)
	}
	return resp, nil
}

// reapedElsewhere reports whether a wait for a child failed because the
// shim's reaper (containerd's, which waits for any child on SIGCHLD) took
// its exit first: the child ran; what it answered is checked instead.
func reapedElsewhere(err error) bool { return errors.Is(err, syscall.ECHILD) }
