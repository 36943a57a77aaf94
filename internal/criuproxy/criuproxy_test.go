package criuproxy

import (
	"math/rand"
	"testing"

	"github.com/checkpoint-restore/go-criu/v7/rpc"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protoreflect"
)

// TestWireNumbers: the request type and field numbers the decoder reads are
// go-criu's (CRIU's images/rpc.proto).
func TestWireNumbers(t *testing.T) {
	if ReqVersion != int(rpc.CriuReqType_VERSION) {
		t.Errorf("ReqVersion = %d, go-criu's VERSION = %d", ReqVersion, rpc.CriuReqType_VERSION)
	}
	fields := (&rpc.CriuReq{}).ProtoReflect().Descriptor().Fields()
	for name, want := range map[string]int{"type": fieldType, "keep_open": fieldKeepOpen} {
		f := fields.ByName(protoreflect.Name(name))
		if f == nil {
			t.Fatalf("go-criu's criu_req has no field %s", name)
		}
		if int(f.Number()) != want {
			t.Errorf("criu_req.%s is field %d in go-criu, %d here", name, f.Number(), want)
		}
	}
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

// TestParseGoCriuRequests: the decoder reads the type and keep_open of
// go-criu's marshalled requests as protobuf does.
func TestParseGoCriuRequests(t *testing.T) {
	for name, req := range goCriuRequests() {
		b, err := proto.Marshal(req)
		if err != nil {
			t.Fatal(err)
		}
		got, err := ParseRequest(b)
		if err != nil {
			t.Errorf("%s: %v (% x)", name, err, b)
			continue
		}
		if got.Type != uint64(req.GetType()) || !got.HasType || got.KeepOpen != req.GetKeepOpen() {
			t.Errorf("%s: parsed %+v, want type %d keep_open %v", name, got, req.GetType(), req.GetKeepOpen())
		}
		isVersion := got.Type == ReqVersion && !got.KeepOpen
		if want := name == "version" || name == "version-with-opts" || name == "version-notify"; isVersion != want {
			t.Errorf("%s: answered from the cache: %v, want %v", name, isVersion, want)
		}
	}
	// Protobuf's rule: the last of a repeated scalar counts.
	twice := append(mustMarshal(t, &rpc.CriuReq{Type: rpc.CriuReqType_VERSION.Enum()}),
		mustMarshal(t, &rpc.CriuReq{Type: rpc.CriuReqType_RESTORE.Enum()})...)
	var pb rpc.CriuReq
	if err := proto.Unmarshal(twice, &pb); err != nil {
		t.Fatal(err)
	}
	if got, err := ParseRequest(twice); err != nil || got.Type != uint64(pb.GetType()) {
		t.Errorf("VERSION then RESTORE: %+v, %v; protobuf reads %v", got, err, pb.GetType())
	}
}

// TestParseGarbage: what is not a request is refused (the real CRIU gets it).
func TestParseGarbage(t *testing.T) {
	for name, b := range map[string][]byte{
		"empty":            {},
		"no type":          {0x20, 0x00, 0x30, 0x01}, // keep_open false, pid 1
		"truncated varint": {0x08, 0x8a},
		"truncated bytes":  {0x08, 0x0a, 0x12, 0x05, 0x01},
		"group":            {0x08, 0x0a, 0x1b, 0x1c},
		"field 0":          {0x00, 0x0a},
		"type as bytes":    {0x0a, 0x01, 0x0a},
		"long varint":      {0x08, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x7f},
		"text":             []byte("VERSION\n"),
	} {
		if r, err := ParseRequest(b); err == nil {
			t.Errorf("%s (% x): parsed as %+v", name, b, r)
		}
	}
}

// TestParseCorrupted: corrupted requests are refused or read as protobuf
// reads them; never a VERSION protobuf does not see.
func TestParseCorrupted(t *testing.T) {
	rng := rand.New(rand.NewSource(1))
	var reqs [][]byte
	for _, r := range goCriuRequests() {
		reqs = append(reqs, mustMarshal(t, r))
	}
	for i := 0; i < 50000; i++ {
		b := append([]byte(nil), reqs[rng.Intn(len(reqs))]...)
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
		got, err := ParseRequest(b)
		if err != nil {
			continue
		}
		var pb rpc.CriuReq
		if perr := proto.Unmarshal(b, &pb); perr != nil {
			// Only the top level is read; a nested field protobuf refuses
			// is CRIU's to refuse, and only matters for a VERSION.
			continue
		}
		// An enum value go-criu does not know stays in pb's unknown fields.
		if pb.Type != nil && int32(got.Type) != int32(pb.GetType()) || got.KeepOpen != pb.GetKeepOpen() {
			t.Fatalf("% x: parsed %+v, protobuf type %d keep_open %v", b, got, pb.GetType(), pb.GetKeepOpen())
		}
	}
}

func TestSwrkFD(t *testing.T) {
	for _, c := range []struct {
		args []string
		fd   int
	}{
		{[]string{"criu", "swrk", "3"}, 3},
		{[]string{"/x/criu", "swrk", "12"}, 12},
		{[]string{"criu", "swrk", "03"}, -1},
		{[]string{"criu", "swrk", "-1"}, -1},
		{[]string{"criu", "swrk"}, -1},
		{[]string{"criu", "swrk", "3", "x"}, -1},
		{[]string{"criu", "-v4", "swrk", "3"}, -1},
		{[]string{"criu", "check"}, -1},
		{[]string{"criu", "--version"}, -1},
	} {
		if got := swrkFD(c.args); got != c.fd {
			t.Errorf("%q: fd %d, want %d", c.args, got, c.fd)
		}
	}
}

func mustMarshal(t *testing.T, m proto.Message) []byte {
	t.Helper()
	b, err := proto.Marshal(m)
	if err != nil {
		t.Fatal(err)
	}
	return b
}
