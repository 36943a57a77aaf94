package shim

import (
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"

	criu "github.com/checkpoint-restore/go-criu/v7"
	"github.com/checkpoint-restore/go-criu/v7/rpc"
	"google.golang.org/protobuf/proto"

	"github.com/lazyfork/lazyfork/internal/criuproxy"
	"github.com/lazyfork/lazyfork/internal/testutil"
)

// fakeShim lays out a shim binary's directory with the proxy (this test
// binary linked as criu-proxy/criu, see TestMain) and returns the shim's path.
func fakeShim(t *testing.T) string {
	t.Helper()
	test, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	if err := os.Chmod(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	self := filepath.Join(dir, "containerd-shim-lazyfork-v1-full")
	if err := os.Mkdir(criuProxyDir(self), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink(test, filepath.Join(criuProxyDir(self), "criu")); err != nil {
		t.Fatal(err)
	}
	return self
}

// TestCRIUProxySetup: the shim caches the real CRIU's answer to a VERSION
// request and puts the proxy first on the PATH runc inherits; go-criu (as
// runc calls it, "criu" from PATH) then gets the real version. Off with
// LAZYFORK_CRIU_PROXY=off, and with a proxy directory others can write.
func TestCRIUProxySetup(t *testing.T) {
	realCriu := testutil.RequiresCRIU(t)
	if inPrivateMountNS(t, "TestCRIUProxySetup") {
		return
	}
	privateRunOnDisk(t)
	for _, k := range []string{"PATH", criuproxy.EnvReal, criuproxy.EnvCacheDir, criuProxyEnv, "LAZYFORK_CRIU_KDAT"} {
		t.Setenv(k, os.Getenv(k))
	}
	path := os.Getenv("PATH")
	self := fakeShim(t)

	// Off: runc's PATH stays as it was.
	os.Setenv(criuProxyEnv, "off")
	(&kerndat{}).ensure(context.Background(), self, true)
	if got := os.Getenv("PATH"); got != path {
		t.Fatalf("LAZYFORK_CRIU_PROXY=off: PATH %s, was %s", got, path)
	}
	os.Unsetenv(criuProxyEnv)

	// A proxy directory others can write is refused.
	if err := os.Chmod(criuProxyDir(self), 0o777); err != nil {
		t.Fatal(err)
	}
	if err := setupCRIUProxy(self, realCriu); err == nil || os.Getenv("PATH") != path {
		t.Fatalf("a world-writable %s was put on PATH (%v): %s", criuProxyDir(self), err, os.Getenv("PATH"))
	}
	if err := os.Chmod(criuProxyDir(self), 0o755); err != nil {
		t.Fatal(err)
	}

	(&kerndat{}).ensure(context.Background(), self, true)
	if first, _, _ := strings.Cut(os.Getenv("PATH"), ":"); first != criuProxyDir(self) {
		t.Fatalf("PATH %s: the proxy's directory %s is not first", os.Getenv("PATH"), criuProxyDir(self))
	}
	dir, err := criuCacheDir()
	if err != nil {
		t.Fatal(err)
	}
	if os.Getenv(criuproxy.EnvReal) != realCriu || os.Getenv(criuproxy.EnvCacheDir) != dir {
		t.Fatalf("proxy environment %s=%s %s=%s, want %s and %s", criuproxy.EnvReal, os.Getenv(criuproxy.EnvReal),
			criuproxy.EnvCacheDir, os.Getenv(criuproxy.EnvCacheDir), realCriu, dir)
	}
	if again, err := realCRIU(self); err != nil || again != realCriu {
		t.Fatalf("the real CRIU with the proxy on PATH: %q %v, want %s", again, err, realCriu)
	}
	cached, err := criuproxy.ReadCache(dir, realCriu, 0)
	if err != nil {
		t.Fatal(err)
	}
	var r rpc.CriuResp
	if err := proto.Unmarshal(cached, &r); err != nil || r.GetType() != rpc.CriuReqType_VERSION || !r.GetSuccess() {
		t.Fatalf("cached answer %v, %v", &r, err)
	}

	direct := criu.MakeCriu()
	direct.SetCriuPath(realCriu)
	want, err := direct.GetCriuVersion()
	if err != nil {
		t.Fatal(err)
	}
	// Replace the cache with a marker: go-criu's answer comes from it.
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
	got, err := criu.MakeCriu().GetCriuVersion()
	if err != nil || got != want+700 {
		t.Fatalf("go-criu through PATH: version %d, %v; want the cache's %d", got, err, want+700)
	}
	if err := os.WriteFile(filepath.Join(dir, name), cached, 0o600); err != nil {
		t.Fatal(err)
	}
	if got, err := criu.MakeCriu().GetCriuVersion(); err != nil || got != want {
		t.Fatalf("go-criu through PATH: version %d, %v; want %d", got, err, want)
	}
}
