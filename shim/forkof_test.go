package shim

import (
	"archive/tar"
	"bytes"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/containerd/errdefs"
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
		if _, _, err := resolveForkOf(cfg, "ns", "id", ref); err == nil || !strings.Contains(err.Error(), AnnotationForkOf) {
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
		{map[string]string{AnnotationForkOf: "/s"}, "/s"},
		{map[string]string{AnnotationForkOf: "/s", annotationCRIContainerType: "sandbox"}, ""},
		{map[string]string{AnnotationForkOf: "/s", annotationCRIContainerType: "container", annotationCRIContainerName: "app"}, "/s"},
		{map[string]string{AnnotationForkOf: "/s", AnnotationForkContainer: "app", annotationCRIContainerName: "app"}, "/s"},
		{map[string]string{AnnotationForkOf: "/s", AnnotationForkContainer: "app", annotationCRIContainerName: "sidecar"}, ""},
		{nil, ""},
	} {
		if got := forkOf(c.a); got != c.want {
			t.Errorf("forkOf(%v) = %q, want %q", c.a, got, c.want)
		}
	}
}
