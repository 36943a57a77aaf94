package harness

import (
	"archive/tar"
	"bytes"
	"compress/gzip"
	"io"
	"testing"

	"github.com/opencontainers/go-digest"
)

func TestSplitRef(t *testing.T) {
	for _, tc := range []struct{ ref, repo, tag string }{
		{"registry.k8s.io/e2e-test-images/busybox:1.29-2", "e2e-test-images/busybox", "1.29-2"},
		{"gcr.io/k8s-staging-cri-tools/test-image-latest", "k8s-staging-cri-tools/test-image-latest", "latest"},
		{"gcr.io/k8s-staging-cri-tools/test-image-digest@sha256:9700f9a2", "k8s-staging-cri-tools/test-image-digest", "latest"},
		{"localhost:5000/a/b:c", "a/b", "c"},
	} {
		repo, tag, err := splitRef(tc.ref)
		if err != nil || repo != tc.repo || tag != tc.tag {
			t.Errorf("splitRef(%q) = %q %q %v, want %q %q", tc.ref, repo, tag, err, tc.repo, tc.tag)
		}
	}
	if _, _, err := splitRef("busybox"); err == nil {
		t.Error("splitRef of a reference without host: no error")
	}
}

// TestFilesLayer: files land with their directories and modes (a setuid
// program keeps its bit), and the diff_id is the uncompressed tar's digest.
func TestFilesLayer(t *testing.T) {
	layer, diffID, err := filesLayer(map[string]string{"usr/local/bin/nnp": "x", "www/index.html": "hi"},
		map[string]int64{"usr/local/bin/nnp": 0o4755})
	if err != nil {
		t.Fatal(err)
	}
	zr, err := gzip.NewReader(bytes.NewReader(layer))
	if err != nil {
		t.Fatal(err)
	}
	raw, err := io.ReadAll(zr)
	if err != nil {
		t.Fatal(err)
	}
	if digest.FromBytes(raw) != diffID {
		t.Errorf("diff_id %s is not the tar's digest", diffID)
	}
	got := map[string]int64{}
	tr := tar.NewReader(bytes.NewReader(raw))
	for {
		h, err := tr.Next()
		if err == io.EOF {
			break
		}
		if err != nil {
			t.Fatal(err)
		}
		got[h.Name] = h.Mode
	}
	want := map[string]int64{"usr/": 0o755, "usr/local/": 0o755, "usr/local/bin/": 0o755, "usr/local/bin/nnp": 0o4755, "www/": 0o755, "www/index.html": 0o644}
	for n, m := range want {
		if got[n] != m {
			t.Errorf("%s: mode %o, want %o (entries %v)", n, got[n], m, got)
		}
	}
}
