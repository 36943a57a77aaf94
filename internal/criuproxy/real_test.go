package criuproxy

import (
	"bytes"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"testing"
	"time"

	criu "github.com/checkpoint-restore/go-criu/v7"
	"github.com/checkpoint-restore/go-criu/v7/rpc"
	"golang.org/x/sys/unix"
	"google.golang.org/protobuf/proto"

	"github.com/lazyfork/lazyfork/internal/testutil"
)

// TestMain: the test binary run as `criu` (through a link of that name) is
// the proxy.
func TestMain(m *testing.M) {
	if filepath.Base(os.Args[0]) == "criu" {
		Main()
	}
	os.Exit(m.Run())
}

// proxyBin links the test binary as a `criu` in a directory of its own.
func proxyBin(t *testing.T) string {
	t.Helper()
	self, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	p := filepath.Join(t.TempDir(), "criu")
	if err := os.Symlink(self, p); err != nil {
		t.Fatal(err)
	}
	return p
}

// swrk runs `bin swrk 3` with env added to the test's, sends req and returns
// the answer as it came.
func swrk(t *testing.T, bin string, env []string, req proto.Message) []byte {
	t.Helper()
	b, err := swrkExit(t, bin, env, req)
	if err != nil {
		t.Fatal(err)
	}
	return b
}

// swrkExit is swrk, returning how the command exited.
func swrkExit(t *testing.T, bin string, env []string, req proto.Message) ([]byte, error) {
	t.Helper()
	fds, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_SEQPACKET|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	cln, srv := os.NewFile(uintptr(fds[0]), "cln"), os.NewFile(uintptr(fds[1]), "srv")
	defer cln.Close()
	cmd := exec.Command(bin, "swrk", "3")
	cmd.Env = append(os.Environ(), env...)
	cmd.ExtraFiles = []*os.File{srv}
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	srv.Close()
	b, err := proto.Marshal(req)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := cln.Write(b); err != nil {
		t.Fatal(err)
	}
	resp := make([]byte, 64<<10)
	n, err := cln.Read(resp)
	if err != nil && err != io.EOF {
		t.Fatal(err)
	}
	cln.Close()
	if err := cmd.Wait(); err != nil {
		return resp[:n], fmt.Errorf("%s swrk: %v: %s", bin, err, stderr.Bytes())
	}
	return resp[:n], nil
}

// writeCache writes b as the version cache of real in dir.
func writeCache(t *testing.T, dir, real string, b []byte) string {
	t.Helper()
	name, err := CacheName(real, VersionSuffix)
	if err != nil {
		t.Fatal(err)
	}
	p := filepath.Join(dir, name)
	if err := os.WriteFile(p, b, 0o600); err != nil {
		t.Fatal(err)
	}
	return p
}

func versionReq() *rpc.CriuReq { return &rpc.CriuReq{Type: rpc.CriuReqType_VERSION.Enum()} }

// TestProxyRealCRIU: through the proxy, a VERSION request is answered from
// the cache (byte-equal to the real CRIU's answer, also for go-criu as runc
// calls it), every other request by the real CRIU; a cache of another build
// of the binary (changed mtime), an untrusted cache or directory, or no cache
// directory at all leave the answer to the real CRIU.
func TestProxyRealCRIU(t *testing.T) {
	realPath := testutil.RequiresCRIU(t)
	// A copy of the real CRIU stands for it, so the test can change it.
	real := filepath.Join(t.TempDir(), "criu")
	b, err := os.ReadFile(realPath)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(real, b, 0o755); err != nil {
		t.Fatal(err)
	}
	proxy := proxyBin(t)
	cache := t.TempDir()
	env := []string{EnvReal + "=" + real, EnvCacheDir + "=" + cache}

	want := swrk(t, real, nil, versionReq())
	var wr rpc.CriuResp
	if err := proto.Unmarshal(want, &wr); err != nil || wr.GetType() != rpc.CriuReqType_VERSION || !wr.GetSuccess() {
		t.Fatalf("the real CRIU's answer: %v %v", &wr, err)
	}
	t.Logf("the real CRIU's answer (%d bytes): %v", len(want), &wr)

	// No cache yet: the real CRIU answers through the proxy.
	if got := swrk(t, proxy, env, versionReq()); !bytes.Equal(got, want) {
		t.Fatalf("through the proxy, no cache: % x, want % x", got, want)
	}

	// A marker in the cache shows who answers.
	marker := func() []byte {
		m := proto.Clone(&wr).(*rpc.CriuResp)
		m.Version.MajorNumber = proto.Int32(99)
		b, err := proto.Marshal(m)
		if err != nil {
			t.Fatal(err)
		}
		return b
	}()
	cacheFile := writeCache(t, cache, real, marker)
	if got := swrk(t, proxy, env, versionReq()); !bytes.Equal(got, marker) {
		t.Fatalf("through the proxy, a cache: % x, want the cache's % x", got, marker)
	}

	// The real answer cached: byte-equal, and go-criu (as runc asks, on an fd
	// other than 3) reads the real version.
	writeCache(t, cache, real, want)
	if got := swrk(t, proxy, env, versionReq()); !bytes.Equal(got, want) {
		t.Fatalf("through the proxy: % x, want % x", got, want)
	}
	for k, v := range map[string]string{EnvReal: real, EnvCacheDir: cache} {
		t.Setenv(k, v)
	}
	c := criu.MakeCriu()
	c.SetCriuPath(real)
	direct, err := c.GetCriuVersion()
	if err != nil {
		t.Fatal(err)
	}
	c = criu.MakeCriu()
	c.SetCriuPath(proxy)
	viaProxy, err := c.GetCriuVersion()
	if err != nil || viaProxy != direct {
		t.Fatalf("go-criu through the proxy: version %d, %v; directly %d", viaProxy, err, direct)
	}

	// Any other request goes to the real CRIU, unread.
	feat := &rpc.CriuReq{Type: rpc.CriuReqType_FEATURE_CHECK.Enum(),
		Features: &rpc.CriuFeatures{MemTrack: proto.Bool(true), LazyPages: proto.Bool(true), PidfdStore: proto.Bool(true)}}
	wantFeat := swrk(t, real, nil, feat)
	if got := swrk(t, proxy, env, feat); !bytes.Equal(got, wantFeat) {
		t.Fatalf("FEATURE_CHECK through the proxy: % x, want the real CRIU's % x", got, wantFeat)
	}
	var fr rpc.CriuResp
	if err := proto.Unmarshal(wantFeat, &fr); err != nil || fr.GetType() != rpc.CriuReqType_FEATURE_CHECK {
		t.Fatalf("FEATURE_CHECK answer: %v %v", &fr, err)
	}
	keep := &rpc.CriuReq{Type: rpc.CriuReqType_VERSION.Enum(), KeepOpen: proto.Bool(true)}
	writeCache(t, cache, real, marker)
	// (CRIU answers, waits for another request, and fails when there is none.)
	wantKeep, wantErr := swrkExit(t, real, nil, keep)
	if got, err := swrkExit(t, proxy, env, keep); !bytes.Equal(got, wantKeep) || (err == nil) != (wantErr == nil) {
		t.Fatalf("a keep_open VERSION request through the proxy: % x (%v); the real CRIU: % x (%v)", got, err, wantKeep, wantErr)
	}
	out, err := exec.Command(proxy, "--version").CombinedOutput()
	if wantOut, _ := exec.Command(real, "--version").CombinedOutput(); err != nil || !bytes.Equal(out, wantOut) {
		t.Fatalf("criu --version through the proxy: %v %q, want %q", err, out, wantOut)
	}

	// Whatever makes the cache untrustworthy or stale: the real CRIU answers.
	for _, c := range []struct {
		name        string
		spoil, undo func() error
		env         []string
	}{
		{"cache writable by others", func() error { return os.Chmod(cacheFile, 0o666) }, func() error { return os.Chmod(cacheFile, 0o600) }, env},
		{"cache of another user", func() error { return os.Chown(cacheFile, 65534, 65534) }, func() error { return os.Chown(cacheFile, 0, 0) }, env},
		{"directory writable by others", func() error { return os.Chmod(cache, 0o777) }, func() error { return os.Chmod(cache, 0o700) }, env},
		{"real CRIU writable by its group", func() error { return os.Chmod(real, 0o775) }, func() error { return os.Chmod(real, 0o755) },
			append(env, "PATH="+filepath.Dir(proxy)+":"+filepath.Dir(real))},
		{"no cache directory given", nil, nil, []string{EnvReal + "=" + real, EnvCacheDir + "="}},
		{"another build of the binary", func() error {
			return os.Chtimes(real, time.Now(), time.Now().Add(-time.Hour))
		}, func() error { return nil }, env},
	} {
		if c.spoil != nil {
			if err := c.spoil(); err != nil {
				t.Fatal(err)
			}
		}
		if got := swrk(t, proxy, c.env, versionReq()); !bytes.Equal(got, want) {
			t.Errorf("%s: through the proxy % x, want the real CRIU's % x", c.name, got, want)
		}
		if c.undo != nil {
			if err := c.undo(); err != nil {
				t.Fatal(err)
			}
		}
	}
}
