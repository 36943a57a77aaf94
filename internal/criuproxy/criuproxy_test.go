package criuproxy

import (
	"bytes"
	"encoding/binary"
	"encoding/hex"
	"fmt"
	"io"
	"math/rand"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/checkpoint-restore/go-criu/v7/rpc"
	"golang.org/x/sys/unix"
	"google.golang.org/protobuf/proto"
)

// built is the proxy compiled once for this test binary: criu and tar (one
// binary), and the decoder's test driver.
var built struct {
	once              sync.Once
	criu, tar, driver string
	err               error
}

func TestMain(m *testing.M) {
	code := m.Run()
	if built.criu != "" {
		os.RemoveAll(filepath.Dir(built.criu))
	}
	os.Exit(code)
}

// proxy returns the C proxy's criu and tar (built from this tree with gcc)
// and its decoder's test driver; without gcc the test is skipped (failed
// under CI=true).
func proxy(t *testing.T) (criu, tar, driver string) {
	t.Helper()
	if _, err := exec.LookPath("gcc"); err != nil {
		if os.Getenv("CI") == "true" {
			t.Fatal("gcc not found: install build-essential (make deps)")
		}
		t.Skip("gcc not found: install build-essential (make deps)")
	}
	built.once.Do(func() {
		dir, err := os.MkdirTemp("", "criuproxy-test-")
		if err != nil {
			built.err = err
			return
		}
		if err := os.Chmod(dir, 0o755); err != nil {
			built.err = err
			return
		}
		if built.criu, built.err = Build(dir); built.err != nil {
			return
		}
		built.tar = filepath.Join(dir, "tar")
		drv := filepath.Join(dir, "driver")
		if err := os.Mkdir(drv, 0o755); err != nil {
			built.err = err
			return
		}
		var d string
		d, built.err = Build(drv, "-DLAZYFORK_PROXY_TEST")
		built.driver = d
	})
	if built.err != nil {
		t.Fatal(built.err)
	}
	return built.criu, built.tar, built.driver
}

// parsed is what the C decoder reads of each request: "type keep_open" (keep
// 0 or 1) or "error".
func parsed(t *testing.T, reqs [][]byte) []string {
	t.Helper()
	_, _, driver := proxy(t)
	var in bytes.Buffer
	for _, b := range reqs {
		binary.Write(&in, binary.LittleEndian, uint32(len(b)))
		in.Write(b)
	}
	cmd := exec.Command(driver)
	cmd.Stdin = &in
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("the decoder's driver: %v", err)
	}
	lines := strings.Split(strings.TrimSuffix(string(out), "\n"), "\n")
	if len(lines) != len(reqs) {
		t.Fatalf("the decoder's driver read %d of %d requests", len(lines), len(reqs))
	}
	return lines
}

// goCriuRequests are requests as go-criu (and so runc) marshals them.
func goCriuRequests() map[string]*rpc.CriuReq {
	b := proto.Bool
	s := proto.String
	i := proto.Int32
	return map[string]*rpc.CriuReq{
		"version": {Type: rpc.CriuReqType_VERSION.Enum()},
		"version-with-opts": {Type: rpc.CriuReqType_VERSION.Enum(),
			Opts: &rpc.CriuOpts{ImagesDirFd: i(7), LogLevel: i(4)}},
		"restore": {Type: rpc.CriuReqType_RESTORE.Enum(), Opts: &rpc.CriuOpts{
			ImagesDirFd: i(3), WorkDirFd: i(4), LogFile: s("restore.log"), LogLevel: i(1),
			Root: s("/run/containerd/rootfs"), ManageCgroups: b(true), NotifyScripts: b(true),
			ShellJob: b(false), FileLocks: b(true), OrphanPtsMaster: b(true),
			ConfigFile: s("/etc/criu/runc.conf"), RstSibling: b(true),
			ExtMnt:    []*rpc.ExtMountMap{{Key: s("/.lazyfork/mem"), Val: s("/run/lazyfork/mem/f")}},
			InheritFd: []*rpc.InheritFd{{Key: s("pipe:[1234]"), Fd: i(5)}},
			External:  []string{"mnt[/etc/hosts]:/etc/hosts"},
		}},
		"dump": {Type: rpc.CriuReqType_DUMP.Enum(), Opts: &rpc.CriuOpts{
			ImagesDirFd: i(3), LeaveRunning: b(true), TcpEstablished: b(false),
			Pid: i(4242), GhostLimit: proto.Uint32(1 << 20),
		}},
		"feature-check": {Type: rpc.CriuReqType_FEATURE_CHECK.Enum(),
			Features: &rpc.CriuFeatures{MemTrack: b(true), LazyPages: b(true), PidfdStore: b(true)}},
		"check":           {Type: rpc.CriuReqType_CHECK.Enum()},
		"version-keep":    {Type: rpc.CriuReqType_VERSION.Enum(), KeepOpen: b(true)},
		"version-notify":  {Type: rpc.CriuReqType_VERSION.Enum(), NotifySuccess: b(true), Pid: proto.Uint32(9)},
		"wait-pid":        {Type: rpc.CriuReqType_WAIT_PID.Enum(), Pid: proto.Uint32(12345)},
		"page-server-chl": {Type: rpc.CriuReqType_PAGE_SERVER_CHLD.Enum(), KeepOpen: b(true)},
	}
}

// answered is whether the proxy answers a request itself.
func answered(name string) bool {
	return name == "version" || name == "version-with-opts" || name == "version-notify"
}

// garbage is what is no request (the real CRIU gets it).
var garbage = map[string][]byte{
	"empty":            {},
	"no type":          {0x20, 0x00, 0x30, 0x01}, // keep_open false, pid 1
	"truncated varint": {0x08, 0x8a},
	"truncated bytes":  {0x08, 0x0a, 0x12, 0x05, 0x01},
	"group":            {0x08, 0x0a, 0x1b, 0x1c},
	"field 0":          {0x00, 0x0a},
	"type as bytes":    {0x0a, 0x01, 0x0a},
	"long varint":      {0x08, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x7f},
	"text":             []byte("VERSION\n"),
}

// TestParseGoCriuRequests: the C decoder reads the type and keep_open of
// go-criu's marshalled requests as protobuf does (the request type and field
// numbers are go-criu's, CRIU's images/rpc.proto), and the last of a field
// given twice.
func TestParseGoCriuRequests(t *testing.T) {
	var names []string
	var reqs [][]byte
	want := map[string]string{}
	for name, req := range goCriuRequests() {
		names = append(names, name)
		reqs = append(reqs, mustMarshal(t, req))
		want[name] = fmt.Sprintf("%d %d", req.GetType(), map[bool]int{false: 0, true: 1}[req.GetKeepOpen()])
		if (req.GetType() == rpc.CriuReqType_VERSION && !req.GetKeepOpen()) != answered(name) {
			t.Fatalf("%s: the test's answered() is wrong", name)
		}
	}
	twice := append(mustMarshal(t, &rpc.CriuReq{Type: rpc.CriuReqType_VERSION.Enum()}),
		mustMarshal(t, &rpc.CriuReq{Type: rpc.CriuReqType_RESTORE.Enum(), KeepOpen: proto.Bool(true)})...)
	names, reqs = append(names, "VERSION then RESTORE"), append(reqs, twice)
	want["VERSION then RESTORE"] = fmt.Sprintf("%d 1", rpc.CriuReqType_RESTORE)
	for name, b := range garbage {
		names, reqs = append(names, name), append(reqs, b)
		want[name] = "error"
	}
	for i, got := range parsed(t, reqs) {
		if got != want[names[i]] {
			t.Errorf("%s (% x): read %q, want %q", names[i], reqs[i], got, want[names[i]])
		}
	}
}

// TestParseCorrupted: corrupted requests are refused or read as protobuf
// reads them; never a VERSION protobuf does not see.
func TestParseCorrupted(t *testing.T) {
	rng := rand.New(rand.NewSource(1))
	var good [][]byte
	for _, r := range goCriuRequests() {
		good = append(good, mustMarshal(t, r))
	}
	var reqs [][]byte
	for i := 0; i < 50000; i++ {
		b := append([]byte(nil), good[rng.Intn(len(good))]...)
		for n := 1 + rng.Intn(3); n > 0 && len(b) > 0; n-- {
			switch rng.Intn(3) {
			case 0:
				b[rng.Intn(len(b))] = byte(rng.Intn(256))
			case 1:
				b = b[:rng.Intn(len(b))]
			case 2:
				b = append(b, byte(rng.Intn(256)))
			}
		}
		reqs = append(reqs, b)
	}
	refused := 0
	for i, got := range parsed(t, reqs) {
		if got == "error" {
			refused++
			continue
		}
		var typ uint64
		var keep int
		if _, err := fmt.Sscanf(got, "%d %d", &typ, &keep); err != nil {
			t.Fatalf("driver line %q", got)
		}
		var pb rpc.CriuReq
		if err := proto.Unmarshal(reqs[i], &pb); err != nil {
			// Only the top level is read; a nested field protobuf refuses
			// is CRIU's to refuse, and only matters for a VERSION.
			continue
		}
		// An enum value go-criu does not know stays in pb's unknown fields.
		if pb.Type != nil && int32(typ) != int32(pb.GetType()) || (keep == 1) != pb.GetKeepOpen() {
			t.Fatalf("% x: read %q, protobuf type %d keep_open %v", reqs[i], got, pb.GetType(), pb.GetKeepOpen())
		}
	}
	t.Logf("%d of %d corrupted requests refused", refused, len(reqs))
}

// fakeScript is a stand-in for the real CRIU: it answers the request on the
// swrk socket (`criu swrk FD`) with "real CRIU " and the request in hex.
const fakeScript = "#!/bin/sh\neval \"exec 9<&$2\"\nreq=$(dd bs=65536 count=1 <&9 2>/dev/null | od -An -v -tx1 | tr -d ' \\n')\nprintf 'real CRIU %s' \"$req\" >&9\n"

// fakeCRIU writes a `criu` that runs fakeScript.

func fakeCRIU(t *testing.T) string {
	t.Helper()
	p := filepath.Join(t.TempDir(), "criu")
	if err := os.WriteFile(p, []byte(fakeScript), 0o755); err != nil {
		t.Fatal(err)
	}
	return p
}

// answerEnv is the environment the shim sets: real's path and identity, and
// answer.
func answerEnv(t *testing.T, real string, answer []byte) []string {
	t.Helper()
	id, err := ID(real)
	if err != nil {
		t.Fatal(err)
	}
	return []string{EnvReal + "=" + real, EnvRealID + "=" + id, EnvVersionAnswer + "=" + hex.EncodeToString(answer)}
}

// TestProxyAnswersVersionOnly: the proxy binary, run as go-criu runs CRIU
// (`criu swrk N`, N the socket's own descriptor), answers VERSION requests without keep_open from the environment
// and leaves every other request, and garbage, to the real CRIU; likewise
// when the environment's answer is not for the real CRIU as it is now, or
// is no hex.
func TestProxyAnswersVersionOnly(t *testing.T) {
	criu, _, _ := proxy(t)
	real := fakeCRIU(t)
	marker := []byte("cached\x00answer")
	env := answerEnv(t, real, marker)
	for name, req := range goCriuRequests() {
		b := mustMarshal(t, req)
		want := "real CRIU " + hex.EncodeToString(b)
		if answered(name) {
			want = string(marker)
		}
		if got, err := swrkRaw(t, criu, env, b); err != nil || string(got) != want {
			t.Errorf("%s: %q (%v), want %q", name, got, err, want)
		}
	}
	for name, b := range garbage {
		if name == "empty" {
			continue // a zero-length message reads as the end of the stream
		}
		if got, err := swrkRaw(t, criu, env, b); err != nil || string(got) != "real CRIU "+hex.EncodeToString(b) {
			t.Errorf("%s: %q (%v), want the real CRIU's answer", name, got, err)
		}
	}
	version := mustMarshal(t, &rpc.CriuReq{Type: rpc.CriuReqType_VERSION.Enum()})
	for name, e := range map[string][]string{
		"another identity": append(env, EnvRealID+"=1:2:3:4"),
		"odd hex":          append(env, EnvVersionAnswer+"=abc"),
		"no hex":           append(env, EnvVersionAnswer+"=zz"),
		"no answer":        append(env, EnvVersionAnswer+"="),
		"no identity":      {EnvReal + "=" + real, EnvVersionAnswer + "=" + hex.EncodeToString(marker)},
	} {
		if got, err := swrkRaw(t, criu, e, version); err != nil || string(got) != "real CRIU "+hex.EncodeToString(version) {
			t.Errorf("%s: %q (%v), want the real CRIU's answer", name, got, err)
		}
	}
	// Another command line: the real CRIU, same arguments.
	if err := os.WriteFile(real, []byte("#!/bin/sh\necho \"real $*\"\n"), 0o755); err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(criu, "swrk", "3", "x")
	cmd.Env = append(os.Environ(), env...)
	if out, err := cmd.Output(); err != nil || string(out) != "real swrk 3 x\n" {
		t.Errorf("criu swrk 3 x: %q %v", out, err)
	}
}

// TestProxyLeavesRuncsRequestsToRealCRIU: `criu swrk 3` is runc's own run of
// CRIU (a dump, a restore, a feature check: the socket is its first extra
// file), never its version check (go-criu's), so even a VERSION request
// there goes to the real CRIU, which the proxy starts without waiting.
func TestProxyLeavesRuncsRequestsToRealCRIU(t *testing.T) {
	criu, _, _ := proxy(t)
	real := fakeCRIU(t)
	env := answerEnv(t, real, []byte("cached\x00answer"))
	for name, req := range goCriuRequests() {
		b := mustMarshal(t, req)
		if got, err := swrkFD(t, criu, 3, env, b, nil); err != nil || string(got) != "real CRIU "+hex.EncodeToString(b) {
			t.Errorf("%s on fd 3: %q (%v), want the real CRIU's answer", name, got, err)
		}
	}
}

// TestProxyLeavesLateRequestToRealCRIU: a request that has not come soon
// after the proxy starts (runc puts CRIU into the container's cgroups before
// a restore's) is the real CRIU's, which starts before the request comes, so
// that it loads while runc works; a late version request is then answered by
// the real CRIU too.
func TestProxyLeavesLateRequestToRealCRIU(t *testing.T) {
	criu, _, _ := proxy(t)
	started := filepath.Join(t.TempDir(), "started")
	real := filepath.Join(t.TempDir(), "criu")
	script := "#!/bin/sh\n: > " + started + "\n" + strings.SplitN(fakeScript, "\n", 2)[1]
	if err := os.WriteFile(real, []byte(script), 0o755); err != nil {
		t.Fatal(err)
	}
	env := answerEnv(t, real, []byte("cached\x00answer"))
	version := mustMarshal(t, &rpc.CriuReq{Type: rpc.CriuReqType_VERSION.Enum()})
	got, err := swrkFD(t, criu, goCriuFD, env, version, func() {
		for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(time.Millisecond) {
			if _, err := os.Stat(started); err == nil {
				return
			}
			if time.Now().After(deadline) {
				t.Fatal("the real CRIU did not start before its request was sent")
			}
		}
	})
	if want := "real CRIU " + hex.EncodeToString(version); err != nil || string(got) != want {
		t.Errorf("a late version request: %q (%v), want %q", got, err, want)
	}
}

// goCriuFD is where the tests put the socket of go-criu's runs: go-criu
// hands CRIU the socketpair's own descriptor, 4 or more.
const goCriuFD = 4

// swrkRaw runs `bin swrk 4` as go-criu does, with env added to the test's
// and req already sent (as runc's version request is, at once: the proxy
// waits for it only briefly), and returns the answer as it came.
func swrkRaw(t *testing.T, bin string, env []string, req []byte) ([]byte, error) {
	t.Helper()
	return swrkFD(t, bin, goCriuFD, env, req, nil)
}

// swrkFD runs `bin swrk fd`, the socket at fd, and sends req: before the
// start, or once before returns if it is not nil.
func swrkFD(t *testing.T, bin string, fd int, env []string, req []byte, before func()) ([]byte, error) {
	t.Helper()
	fds, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_SEQPACKET|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	cln, srv := os.NewFile(uintptr(fds[0]), "cln"), os.NewFile(uintptr(fds[1]), "srv")
	defer cln.Close()
	cmd := exec.Command(bin, "swrk", strconv.Itoa(fd))
	cmd.Env = append(os.Environ(), env...)
	for len(cmd.ExtraFiles) < fd-3 {
		null, err := os.Open(os.DevNull)
		if err != nil {
			t.Fatal(err)
		}
		defer null.Close()
		cmd.ExtraFiles = append(cmd.ExtraFiles, null)
	}
	cmd.ExtraFiles = append(cmd.ExtraFiles, srv)
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	send := func() {
		if _, err := cln.Write(req); err != nil {
			t.Fatal(err)
		}
	}
	if before == nil {
		send()
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	srv.Close()
	if before != nil {
		before()
		send()
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

func mustMarshal(t *testing.T, m proto.Message) []byte {
	t.Helper()
	b, err := proto.Marshal(m)
	if err != nil {
		t.Fatal(err)
	}
	return b
}
