package criuproxy

import (
	"bytes"
	"os"
	"os/exec"
	"path/filepath"
	"testing"
	"time"

	criu "github.com/checkpoint-restore/go-criu/v7"
	"github.com/checkpoint-restore/go-criu/v7/rpc"
	"google.golang.org/protobuf/proto"

	"github.com/lazyfork/lazyfork/internal/testutil"
)

// TestProxyRealCRIU: through the proxy, a VERSION request is answered from
// the environment (byte-equal to the real CRIU's answer, also for go-criu as
// runc calls it), every other request by the real CRIU; an answer taken from
// another build of the binary (changed mtime) or none leaves the answer to
// the real CRIU.
func TestProxyRealCRIU(t *testing.T) {
	realPath := testutil.RequiresCRIU(t)
	proxyCRIU, _, _ := proxy(t)
	// A copy of the real CRIU stands for it, so the test can change it.
	real := filepath.Join(t.TempDir(), "criu")
	b, err := os.ReadFile(realPath)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(real, b, 0o755); err != nil {
		t.Fatal(err)
	}
	swrk := func(bin string, env []string, req proto.Message) ([]byte, error) {
		return swrkRaw(t, bin, env, mustMarshal(t, req))
	}
	version := &rpc.CriuReq{Type: rpc.CriuReqType_VERSION.Enum()}
	want, err := swrk(real, nil, version)
	var wr rpc.CriuResp
	if err != nil || proto.Unmarshal(want, &wr) != nil || wr.GetType() != rpc.CriuReqType_VERSION || !wr.GetSuccess() {
		t.Fatalf("the real CRIU's answer: %v %v", &wr, err)
	}
	t.Logf("the real CRIU's answer (%d bytes): %v", len(want), &wr)

	// A marker shows who answers.
	m := proto.Clone(&wr).(*rpc.CriuResp)
	m.Version.MajorNumber = proto.Int32(99)
	marker := mustMarshal(t, m)
	env := answerEnv(t, real, marker)
	if got, err := swrk(proxyCRIU, env, version); err != nil || !bytes.Equal(got, marker) {
		t.Fatalf("through the proxy: % x (%v), want the environment's % x", got, err, marker)
	}
	// No answer given: the real CRIU answers through the proxy.
	if got, err := swrk(proxyCRIU, []string{EnvReal + "=" + real}, version); err != nil || !bytes.Equal(got, want) {
		t.Fatalf("through the proxy, no answer given: % x (%v), want % x", got, err, want)
	}

	// The real answer given: byte-equal, and go-criu (as runc asks, on an fd
	// other than 3) reads the real version.
	env = answerEnv(t, real, want)
	for _, e := range env {
		k, v, _ := bytes.Cut([]byte(e), []byte("="))
		t.Setenv(string(k), string(v))
	}
	c := criu.MakeCriu()
	c.SetCriuPath(real)
	direct, err := c.GetCriuVersion()
	if err != nil {
		t.Fatal(err)
	}
	c = criu.MakeCriu()
	c.SetCriuPath(proxyCRIU)
	viaProxy, err := c.GetCriuVersion()
	if err != nil || viaProxy != direct {
		t.Fatalf("go-criu through the proxy: version %d, %v; directly %d", viaProxy, err, direct)
	}

	// Any other request goes to the real CRIU, unread.
	env = answerEnv(t, real, marker)
	feat := &rpc.CriuReq{Type: rpc.CriuReqType_FEATURE_CHECK.Enum(),
		Features: &rpc.CriuFeatures{MemTrack: proto.Bool(true), LazyPages: proto.Bool(true), PidfdStore: proto.Bool(true)}}
	wantFeat, err := swrk(real, nil, feat)
	var fr rpc.CriuResp
	if err != nil || proto.Unmarshal(wantFeat, &fr) != nil || fr.GetType() != rpc.CriuReqType_FEATURE_CHECK {
		t.Fatalf("FEATURE_CHECK answer: %v %v", &fr, err)
	}
	if got, err := swrk(proxyCRIU, env, feat); err != nil || !bytes.Equal(got, wantFeat) {
		t.Fatalf("FEATURE_CHECK through the proxy: % x (%v), want the real CRIU's % x", got, err, wantFeat)
	}
	// (CRIU answers, waits for another request, and fails when there is none.)
	keep := &rpc.CriuReq{Type: rpc.CriuReqType_VERSION.Enum(), KeepOpen: proto.Bool(true)}
	wantKeep, wantErr := swrk(real, nil, keep)
	if got, err := swrk(proxyCRIU, env, keep); !bytes.Equal(got, wantKeep) || (err == nil) != (wantErr == nil) {
		t.Fatalf("a keep_open VERSION request through the proxy: % x (%v); the real CRIU: % x (%v)", got, err, wantKeep, wantErr)
	}
	cmd := exec.Command(proxyCRIU, "--version")
	cmd.Env = append(os.Environ(), env...)
	out, err := cmd.CombinedOutput()
	if wantOut, _ := exec.Command(real, "--version").CombinedOutput(); err != nil || !bytes.Equal(out, wantOut) {
		t.Fatalf("criu --version through the proxy: %v %q, want %q", err, out, wantOut)
	}

	// Another build of the binary (the shim asks it again): the real CRIU answers.
	if err := os.Chtimes(real, time.Now(), time.Now().Add(-time.Hour)); err != nil {
		t.Fatal(err)
	}
	if got, err := swrk(proxyCRIU, env, version); err != nil || !bytes.Equal(got, want) {
		t.Errorf("another build: through the proxy % x (%v), want the real CRIU's % x", got, err, want)
	}
}
