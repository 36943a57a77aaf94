package shim

import (
	"archive/tar"
	"bytes"
	"context"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"testing"

	"github.com/containerd/containerd/v2/core/mount"
	"github.com/containerd/errdefs"
	"github.com/containerd/ttrpc"

	"github.com/lazyfork/lazyfork/api"
	"github.com/lazyfork/lazyfork/node"
	pb "github.com/lazyfork/lazyfork/proto/lazyfork/v1"
)

func writeTar(t *testing.T, entries []tar.Header, body string) string {
	t.Helper()
	var b bytes.Buffer
	tw := tar.NewWriter(&b)
	for _, h := range entries {
		if h.Typeflag == tar.TypeReg {
			h.Size = int64(len(body))
		}
		if err := tw.WriteHeader(&h); err != nil {
			t.Fatal(err)
		}
		if h.Typeflag == tar.TypeReg {
			tw.Write([]byte(body))
		}
	}
	tw.Close()
	p := filepath.Join(t.TempDir(), "a.tar")
	if err := os.WriteFile(p, b.Bytes(), 0o600); err != nil {
		t.Fatal(err)
	}
	return p
}

// Archive entries are untrusted: only plain files one level below checkpoint/
// land in the target, nothing is written outside it, and links are refused.
func TestUnpackCheckpointUntrusted(t *testing.T) {
	outside := t.TempDir()
	a := writeTar(t, []tar.Header{
		{Name: "checkpoint/", Typeflag: tar.TypeDir, Mode: 0o755},
		{Name: "checkpoint/inventory.img", Typeflag: tar.TypeReg, Mode: 0o600},
		{Name: "./checkpoint/pstree.img", Typeflag: tar.TypeReg, Mode: 0o600},
		{Name: "checkpoint/../evil", Typeflag: tar.TypeReg, Mode: 0o600},
		{Name: "../../../../" + outside + "/evil", Typeflag: tar.TypeReg, Mode: 0o600},
		{Name: "checkpoint/sub/deep.img", Typeflag: tar.TypeReg, Mode: 0o600},
		{Name: "spec.dump", Typeflag: tar.TypeReg, Mode: 0o600},
	}, "x")
	dst := t.TempDir()
	if err := unpackCheckpoint(a, dst); err != nil {
		t.Fatal(err)
	}
	ents, _ := os.ReadDir(dst)
	var names []string
	for _, e := range ents {
		names = append(names, e.Name())
	}
	if strings.Join(names, ",") != "inventory.img,pstree.img" {
		t.Fatalf("unpacked %v, want inventory.img,pstree.img", names)
	}
	if ents, _ := os.ReadDir(outside); len(ents) != 0 {
		t.Fatalf("wrote outside the target: %v", ents)
	}

	link := writeTar(t, []tar.Header{{Name: "checkpoint/x.img", Typeflag: tar.TypeSymlink, Linkname: "/etc/passwd"}}, "")
	if err := unpackCheckpoint(link, t.TempDir()); !errdefs.IsInvalidArgument(err) {
		t.Fatalf("symlink entry: %v, want invalid argument", err)
	}
	empty := writeTar(t, []tar.Header{{Name: "spec.dump", Typeflag: tar.TypeReg, Mode: 0o600}}, "x")
	if err := unpackCheckpoint(empty, t.TempDir()); !errdefs.IsInvalidArgument(err) {
		t.Fatalf("no checkpoint entries: %v, want invalid argument", err)
	}
	notTar := filepath.Join(t.TempDir(), "x")
	os.WriteFile(notTar, bytes.Repeat([]byte("garbage!"), 200), 0o600)
	if err := unpackCheckpoint(notTar, t.TempDir()); err == nil {
		t.Fatal("garbage archive accepted")
	}
}

// A bad fork-of value is a clear error and leaves no directory behind.
func TestResolveForkOfBad(t *testing.T) {
	cfg := Config{Root: t.TempDir()}
	for _, ref := range []string{"relative/path", "/nonexistent/lazyfork", t.TempDir()} {
		if _, _, err := resolveForkOf(cfg, "ns", "id", ref); err == nil || !strings.Contains(err.Error(), api.AnnotationForkOf) {
			t.Errorf("fork-of %q: %v, want an error naming the annotation", ref, err)
		}
	}
	bad := writeTar(t, []tar.Header{{Name: "checkpoint/inventory.img", Typeflag: tar.TypeReg, Mode: 0o600}}, "x")
	if _, _, err := resolveForkOf(cfg, "ns", "id", bad); err == nil {
		t.Error("archive without a LazyFork snapshot accepted")
	}
	if ents, _ := os.ReadDir(filepath.Join(cfg.Root, "snapshots")); len(ents) != 0 {
		t.Errorf("left behind: %v", ents)
	}
}

func TestForkOfApplies(t *testing.T) {
	for _, c := range []struct {
		a    map[string]string
		want string
	}{
		{map[string]string{api.AnnotationForkOf: "/s"}, "/s"},
		{map[string]string{api.AnnotationForkOf: "/s", annotationCRIContainerType: "sandbox"}, ""},
		{map[string]string{api.AnnotationForkOf: "/s", annotationCRIContainerType: "container", annotationCRIContainerName: "app"}, "/s"},
		{map[string]string{api.AnnotationForkOf: "/s", api.AnnotationForkContainer: "app", annotationCRIContainerName: "app"}, "/s"},
		{map[string]string{api.AnnotationForkOf: "/s", api.AnnotationForkContainer: "app", annotationCRIContainerName: "sidecar"}, ""},
		{nil, ""},
	} {
		if got := forkOf(c.a); got != c.want {
			t.Errorf("forkOf(%v) = %q, want %q", c.a, got, c.want)
		}
	}
}

// A tiny archive must not expand into the tmpfs: sparse entries are refused
// (10 KB of PAX sparse wrote 512 MB before), and sizes count against one
// budget for the whole image, not a cap per entry.
func TestUnpackCheckpointBounded(t *testing.T) {
	var b bytes.Buffer
	tw := tar.NewWriter(&b)
	// archive/tar will not write a PAX header by hand: write it as a
	// regular entry, then turn its type into 'x' and fix the checksum.
	rec := func(k, v string) string {
		s := " " + k + "=" + v + "\n"
		n := len(s) + 1
		for len(strconv.Itoa(n))+len(s) != n {
			n++
		}
		return strconv.Itoa(n) + s
	}
	pax := rec("GNU.sparse.major", "1") + rec("GNU.sparse.minor", "0") +
		rec("GNU.sparse.realsize", "536870912") + rec("GNU.sparse.name", "checkpoint/pages-1.img")
	tw.WriteHeader(&tar.Header{Name: "pax", Typeflag: tar.TypeReg, Size: int64(len(pax))})
	tw.Write([]byte(pax))
	tw.Flush()
	hdr := b.Bytes()[:512]
	hdr[156] = tar.TypeXHeader
	copy(hdr[148:156], "        ")
	sum := 0
	for _, c := range hdr {
		sum += int(c)
	}
	copy(hdr[148:], fmt.Sprintf("%06o\x00 ", sum))
	tw.WriteHeader(&tar.Header{Name: "checkpoint/pages-1.img", Typeflag: tar.TypeReg, Mode: 0o600, Size: 512})
	sparseMap := make([]byte, 512)
	copy(sparseMap, "0\n") // no data blocks: 512 MiB of holes
	tw.Write(sparseMap)
	tw.Close()
	p := filepath.Join(t.TempDir(), "sparse.tar")
	if err := os.WriteFile(p, b.Bytes(), 0o600); err != nil {
		t.Fatal(err)
	}
	dst := t.TempDir()
	if err := unpackCheckpoint(p, dst); !errdefs.IsInvalidArgument(err) || !strings.Contains(err.Error(), "sparse") {
		t.Fatalf("sparse entry: %v, want invalid argument naming it sparse", err)
	}

	budget, err := archiveBudget(dst)
	if err != nil {
		t.Fatal(err)
	}
	// A small entry, then one of the whole budget: each under any per-entry
	// cap, together over the total; the second header is refused before a
	// byte of it is written.
	b.Reset()
	tw = tar.NewWriter(&b)
	tw.WriteHeader(&tar.Header{Name: "checkpoint/pages-1.img", Typeflag: tar.TypeReg, Mode: 0o600, Size: 4})
	tw.Write([]byte("abcd"))
	tw.WriteHeader(&tar.Header{Name: "checkpoint/pages-2.img", Typeflag: tar.TypeReg, Mode: 0o600, Size: budget})
	tw.Flush()
	os.WriteFile(p, b.Bytes(), 0o600)
	dst = t.TempDir()
	if err := unpackCheckpoint(p, dst); !errdefs.IsResourceExhausted(err) {
		t.Fatalf("image over the budget: %v, want resource exhausted", err)
	}
	if fi, err := os.Stat(filepath.Join(dst, "pages-2.img")); err == nil {
		t.Fatalf("the refused entry was written (%d bytes)", fi.Size())
	}
}

// fork-of may name only LazyFork's snapshot directory or an archive in an
// archive directory, also through symlinks: a pod author must not make the
// shim read any host path.
func TestForkOfPathConfined(t *testing.T) {
	root := t.TempDir()
	archives := t.TempDir()
	cfg := Config{Root: root, ArchiveDirs: []string{archives}}
	snap := filepath.Join(root, "snapshots", "x", "image")
	os.MkdirAll(snap, 0o700)
	arch := filepath.Join(archives, "a.tar")
	os.WriteFile(arch, []byte("x"), 0o600)
	elsewhere := t.TempDir()
	secret := filepath.Join(elsewhere, "secret.tar")
	os.WriteFile(secret, []byte("x"), 0o600)
	sneaky := filepath.Join(archives, "sneaky.tar")
	if err := os.Symlink(secret, sneaky); err != nil {
		t.Fatal(err)
	}
	for _, ok := range []string{snap, arch} {
		if err := cfg.checkForkOfPath(ok); err != nil {
			t.Errorf("%s: %v", ok, err)
		}
	}
	for _, bad := range []string{elsewhere, secret, sneaky, filepath.Join(root, "snapshots"), "/etc"} {
		if err := cfg.checkForkOfPath(bad); !errdefs.IsPermissionDenied(err) {
			t.Errorf("%s: %v, want permission denied", bad, err)
		}
	}
}

// fakeForkOf is the node API's fork-of, recording what the shim asked.
type fakeForkOf struct {
	snap  node.PodSnapshot
	layer node.PodLayer
	image string
	err   error
}

func (f *fakeForkOf) SnapshotForPod(_ context.Context, r node.PodSnapshot) (string, error) {
	f.snap = r
	return f.image, f.err
}

func (f *fakeForkOf) CopySnapshotLayer(_ context.Context, r node.PodLayer) error {
	f.layer = r
	return f.err
}

// serveNodeAPI serves f as the node API at a socket LAZYFORK_API names.
func serveNodeAPI(t *testing.T, f node.ForkOf) {
	t.Helper()
	sock := filepath.Join(t.TempDir(), "api.sock")
	l, err := net.Listen("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	srv, err := ttrpc.NewServer()
	if err != nil {
		t.Fatal(err)
	}
	pb.RegisterNodeService(srv, &node.Service{N: node.NewLocal(t.TempDir()), ForkOf: f})
	go srv.Serve(context.Background(), l)
	t.Cleanup(func() { srv.Close() })
	t.Setenv("LAZYFORK_API", sock)
}

// A fork-of of a running container or a kept snapshot is asked of the node
// API with containerd's address, the namespace, the shim's root and the
// fork's upper directory; the answer is checked as before (under
// ROOT/snapshots), refusals keep their class and name the annotation, and a
// missing API says how to start it.
func TestForkOfAsksNodeAPI(t *testing.T) {
	ctx := context.Background()
	root := t.TempDir()
	s := &Service{cfg: Config{Root: root}}
	t.Setenv("GRPC_ADDRESS", "/run/test-containerd.sock")
	upper := t.TempDir()
	rootfs := []mount.Mount{{Type: "overlay", Source: "overlay", Options: []string{"lowerdir=/l", "upperdir=" + upper, "workdir=/w"}}}
	fc := node.ForkOfContext{Containerd: "/run/test-containerd.sock", Namespace: "k8s.io", Root: root}

	image := filepath.Join(root, "snapshots", "op1", "image")
	f := &fakeForkOf{image: image}
	serveNodeAPI(t, f)
	dir, unpacked, err := s.snapshotRunning(ctx, "k8s.io", "default/web/counter", "default", rootfs)
	if err != nil || dir != image || unpacked != filepath.Dir(image) {
		t.Fatalf("snapshotRunning: %q %q %v, want %q owned by the fork", dir, unpacked, err, image)
	}
	if want := (node.PodSnapshot{ForkOfContext: fc, Ref: "default/web/counter", Upper: upper, PodNamespace: "default"}); f.snap != want {
		t.Errorf("the node API was asked %+v, want %+v", f.snap, want)
	}

	// An answer outside ROOT/snapshots is not trusted.
	f.image = filepath.Join(t.TempDir(), "snapshots", "op1", "image")
	if _, _, err := s.snapshotRunning(ctx, "k8s.io", "web", "", rootfs); !errdefs.IsInternal(err) || !strings.Contains(err.Error(), api.AnnotationForkOf) {
		t.Errorf("an answer outside the root: %v, want an internal error naming the annotation", err)
	}
	f.image, f.err = "", fmt.Errorf("container web did not opt in: %w", errdefs.ErrPermissionDenied)
	if _, _, err := s.snapshotRunning(ctx, "k8s.io", "web", "other", rootfs); !errdefs.IsPermissionDenied(err) ||
		!strings.Contains(err.Error(), api.AnnotationForkOf) || !strings.Contains(err.Error(), "did not opt in") {
		t.Errorf("a refused fork-of: %v, want permission denied naming the annotation and the reason", err)
	}

	// A kept snapshot with a rootfs record gets its layer copied; one
	// without is left as CRI made it and the API is not asked.
	f.err = nil
	kept := filepath.Join(root, "snapshots", "kept", "image")
	if err := os.MkdirAll(kept, 0o700); err != nil {
		t.Fatal(err)
	}
	if copied, err := s.copySnapshotLayer(ctx, "k8s.io", kept, rootfs); copied || err != nil || f.layer != (node.PodLayer{}) {
		t.Fatalf("a snapshot without a rootfs record: copied %v %v, asked %+v", copied, err, f.layer)
	}
	if err := os.WriteFile(filepath.Join(filepath.Dir(kept), api.RootfsFile), []byte("{}"), 0o600); err != nil {
		t.Fatal(err)
	}
	if copied, err := s.copySnapshotLayer(ctx, "k8s.io", kept, rootfs); !copied || err != nil {
		t.Fatalf("copySnapshotLayer: %v %v", copied, err)
	}
	if want := (node.PodLayer{ForkOfContext: fc, ImageDir: kept, Upper: upper}); f.layer != want {
		t.Errorf("the node API was asked %+v, want %+v", f.layer, want)
	}

	// No node API: say what serves it.
	t.Setenv("LAZYFORK_API", filepath.Join(t.TempDir(), "none.sock"))
	if _, _, err := s.snapshotRunning(ctx, "k8s.io", "web", "", rootfs); !errdefs.IsUnavailable(err) ||
		!strings.Contains(err.Error(), "lazyfork-snapshotter") || !strings.Contains(err.Error(), api.AnnotationForkOf) {
		t.Errorf("without a node API: %v, want unavailable naming lazyfork-snapshotter and the annotation", err)
	}
	// Without LAZYFORK_API the shim asks the socket setup serves for its root.
	t.Setenv("LAZYFORK_API", "")
	if got := nodeAPISocket(root); got != api.Root(root).APISocket() {
		t.Errorf("node API socket %q, want %q", got, api.Root(root).APISocket())
	}
}

// The shim binary links neither containerd's Go client nor LazyFork's fork
// client (fork-of asks the node API): they and their package inits
// (distribution/reference's regexps, gRPC's client machinery) cost every
// shim start. gRPC itself stays linked only through containerd's task API
// (api/runtime/task/v3, whose generated gRPC stubs containerd's shim
// package and runc's shim also link).
func TestShimLinksNoContainerdClient(t *testing.T) {
	gobin := filepath.Join(runtime.GOROOT(), "bin", "go")
	if _, err := os.Stat(gobin); err != nil {
		if gobin, err = exec.LookPath("go"); err != nil {
			t.Skip("no go command to list the shim's dependencies")
		}
	}
	out, err := exec.Command(gobin, "list", "-deps", "-f", "{{.ImportPath}} {{join .Imports \" \"}}", "../cmd/containerd-shim-lazyfork-v1").CombinedOutput()
	if err != nil {
		t.Fatalf("go list: %v\n%s", err, out)
	}
	forbidden := []string{
		"github.com/containerd/containerd/v2/client",
		"github.com/distribution/reference",
		"github.com/checkpoint-restore/checkpointctl/lib",
		"github.com/lazyfork/lazyfork/client",
		"github.com/lazyfork/lazyfork/node/forkof",
	}
	grpcImporters := map[string]bool{"github.com/containerd/containerd/api/runtime/task/v3": true}
	for _, line := range strings.Split(strings.TrimSpace(string(out)), "\n") {
		fields := strings.Fields(line)
		if len(fields) == 0 {
			continue
		}
		if slices.Contains(forbidden, fields[0]) {
			t.Errorf("the shim binary links %s", fields[0])
		}
		if slices.Contains(fields[1:], "google.golang.org/grpc") && !grpcImporters[fields[0]] {
			t.Errorf("the shim binary links gRPC through %s", fields[0])
		}
	}
}
