package shim

import (
	"archive/tar"
	"bytes"
	"compress/gzip"
	"context"
	"encoding/hex"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"

	criu "github.com/checkpoint-restore/go-criu/v7"
	"github.com/checkpoint-restore/go-criu/v7/rpc"
	"google.golang.org/protobuf/proto"

	"github.com/lazyfork/lazyfork/internal/criuproxy"
	"github.com/lazyfork/lazyfork/internal/testutil"
)

// fakeShim lays out a shim binary's directory with the proxy (built from this
// tree as criu-proxy/criu and criu-proxy/tar) and returns the shim's path.
func fakeShim(t *testing.T) string {
	t.Helper()
	testutil.RequiresBinary(t, "gcc")
	dir := t.TempDir()
	if err := os.Chmod(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	self := filepath.Join(dir, "containerd-shim-lazyfork-v1-full")
	if err := os.Mkdir(criuProxyDir(self), 0o755); err != nil {
		t.Fatal(err)
	}
	if _, err := criuproxy.Build(criuProxyDir(self)); err != nil {
		t.Fatal(err)
	}
	return self
}

// TestCRIUProxySetup: the shim caches the real CRIU's answer to a VERSION
// request, gives it and the real CRIU's and tar's paths to the proxy, and
// puts the proxy first on the PATH runc inherits; go-criu (as runc calls it,
// "criu" from PATH) then gets the real version, and `tar` from PATH answers
// CRIU's dump of an empty directory and runs the real tar for the rest. Off
// with LAZYFORK_CRIU_PROXY=off, and with a proxy directory others can write.
func TestCRIUProxySetup(t *testing.T) {
	realCriu := testutil.RequiresCRIU(t)
	if inPrivateMountNS(t, "TestCRIUProxySetup") {
		return
	}
	privateRunOnDisk(t)
	for _, k := range []string{"PATH", criuproxy.EnvReal, criuproxy.EnvRealID, criuproxy.EnvVersionAnswer,
		criuproxy.EnvTarReal, criuproxy.EnvGate, criuProxyEnv, "LAZYFORK_CRIU_KDAT"} {
		t.Setenv(k, os.Getenv(k))
	}
	prefix, _ := gatePrefix.Load().(string)
	t.Cleanup(func() { gatePrefix.Store(prefix) })
	path := os.Getenv("PATH")
	realTar, err := exec.LookPath("tar")
	if err != nil {
		t.Fatal(err)
	}
	self := fakeShim(t)

	// Off: runc's PATH stays as it was.
	os.Setenv(criuProxyEnv, "off")
	(&kerndat{}).ensure(context.Background(), self, true)
	if got := os.Getenv("PATH"); got != path {
		t.Fatalf("LAZYFORK_CRIU_PROXY=off: PATH %s, was %s", got, path)
	}
	os.Unsetenv(criuProxyEnv)

	// A proxy directory, or a proxy tar, others can write is refused.
	for _, p := range []string{criuProxyDir(self), filepath.Join(criuProxyDir(self), "tar")} {
		fi, err := os.Stat(p)
		if err != nil {
			t.Fatal(err)
		}
		if err := os.Chmod(p, fi.Mode().Perm()|0o002); err != nil {
			t.Fatal(err)
		}
		if _, err := setupCRIUProxy(self, realCriu); err == nil || os.Getenv("PATH") != path {
			t.Fatalf("a world-writable %s was put on PATH (%v): %s", p, err, os.Getenv("PATH"))
		}
		if err := os.Chmod(p, fi.Mode().Perm()); err != nil {
			t.Fatal(err)
		}
	}

	(&kerndat{}).ensure(context.Background(), self, true)
	if first, _, _ := strings.Cut(os.Getenv("PATH"), ":"); first != criuProxyDir(self) {
		t.Fatalf("PATH %s: the proxy's directory %s is not first", os.Getenv("PATH"), criuProxyDir(self))
	}
	id, err := criuproxy.ID(realCriu)
	if err != nil {
		t.Fatal(err)
	}
	for k, want := range map[string]string{criuproxy.EnvReal: realCriu, criuproxy.EnvRealID: id, criuproxy.EnvTarReal: realTar} {
		if got := os.Getenv(k); got != want {
			t.Errorf("proxy environment %s=%s, want %s", k, got, want)
		}
	}
	if again, err := realCRIU(self); err != nil || again != realCriu {
		t.Fatalf("the real CRIU with the proxy on PATH: %q %v, want %s", again, err, realCriu)
	}
	dir, err := criuCacheDir()
	if err != nil {
		t.Fatal(err)
	}
	cached, err := criuproxy.ReadCache(dir, realCriu, 0)
	if err != nil {
		t.Fatal(err)
	}
	var r rpc.CriuResp
	if err := proto.Unmarshal(cached, &r); err != nil || r.GetType() != rpc.CriuReqType_VERSION || !r.GetSuccess() {
		t.Fatalf("cached answer %v, %v", &r, err)
	}
	if got := os.Getenv(criuproxy.EnvVersionAnswer); got != hex.EncodeToString(cached) {
		t.Fatalf("%s=%s, the cache holds %x", criuproxy.EnvVersionAnswer, got, cached)
	}

	direct := criu.MakeCriu()
	direct.SetCriuPath(realCriu)
	want, err := direct.GetCriuVersion()
	if err != nil {
		t.Fatal(err)
	}
	if got, err := criu.MakeCriu().GetCriuVersion(); err != nil || got != want {
		t.Fatalf("go-criu through PATH: version %d, %v; want %d", got, err, want)
	}
	// Replace the cache with a marker: a shim setting up from it answers
	// go-criu with it.
	m := proto.Clone(&r).(*rpc.CriuResp)
	m.Version.MinorNumber = proto.Int32(r.GetVersion().GetMinorNumber() + 7)
	b, err := proto.Marshal(m)
	if err != nil {
		t.Fatal(err)
	}
	name, err := criuproxy.CacheName(realCriu, criuproxy.VersionSuffix)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(dir, name), b, 0o600); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.WriteFile(filepath.Join(dir, name), cached, 0o600) })
	if gateErr, err := setupCRIUProxy(self, realCriu); err != nil || gateErr != nil {
		t.Fatal(err, gateErr)
	}
	// Dump gates: this shim's own prefix, in a root-only directory beside
	// the cache, known to the shim itself (not only to the environment).
	gates := os.Getenv(criuproxy.EnvGate)
	if want := filepath.Join(dir, "gates", strconv.Itoa(os.Getpid())) + "."; gates != want {
		t.Errorf("%s=%s, want %s", criuproxy.EnvGate, gates, want)
	}
	if got, _ := gatePrefix.Load().(string); got != gates {
		t.Errorf("the shim's gate prefix %q, its environment's %q", got, gates)
	}
	if fi, err := os.Stat(filepath.Dir(gates)); err != nil || fi.Mode().Perm() != 0o700 {
		t.Errorf("gate directory %s: %v %v, want mode 0700", filepath.Dir(gates), fi, err)
	}
	if got, err := criu.MakeCriu().GetCriuVersion(); err != nil || got != want+700 {
		t.Fatalf("go-criu through PATH: version %d, %v; want the cache's %d", got, err, want+700)
	}

	// tar from PATH (as CRIU runs it): an empty directory is answered, the
	// rest goes to the real tar.
	proxyTar, err := exec.LookPath("tar")
	if err != nil || proxyTar != filepath.Join(criuProxyDir(self), "tar") {
		t.Fatalf("tar on PATH: %s %v, want the proxy's", proxyTar, err)
	}
	empty := t.TempDir()
	f, err := os.Open(empty)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	cmd := exec.Command("tar", "--create", "--gzip", "--no-unquote", "--no-wildcards", "--one-file-system", "--check-links",
		"--preserve-permissions", "--sparse", "--numeric-owner", "--directory", "/proc/self/fd/0", ".")
	cmd.Stdin = f
	out, err := cmd.Output()
	if err != nil {
		t.Fatal(err)
	}
	zr, err := gzip.NewReader(bytes.NewReader(out))
	if err != nil {
		t.Fatal(err)
	}
	if h, err := tar.NewReader(zr).Next(); err != nil || h.Name != "./" || h.Typeflag != tar.TypeDir {
		t.Fatalf("CRIU's tar of an empty directory through PATH: %+v %v", h, err)
	}
	if out, err := exec.Command("tar", "--version").Output(); err != nil || !bytes.Contains(out, []byte("GNU tar")) {
		t.Fatalf("tar --version through PATH: %v %q", err, out)
	}
}
