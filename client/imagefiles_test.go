package client

import (
	"archive/tar"
	"bytes"
	"compress/gzip"
	"context"
	"testing"

	"github.com/containerd/containerd/v2/core/content"
	"github.com/containerd/containerd/v2/plugins/content/local"
	"github.com/opencontainers/go-digest"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"
)

type entry struct {
	name, body string
	typ        byte
}

// layer writes a gzipped tar of entries into cs.
func layer(t *testing.T, cs content.Store, entries ...entry) ocispec.Descriptor {
	t.Helper()
	var buf bytes.Buffer
	gz := gzip.NewWriter(&buf)
	tw := tar.NewWriter(gz)
	for _, e := range entries {
		typ := e.typ
		if typ == 0 {
			typ = tar.TypeReg
		}
		h := &tar.Header{Name: e.name, Typeflag: typ, Mode: 0o644, Size: int64(len(e.body))}
		if typ != tar.TypeReg {
			h.Size = 0
			h.Linkname = e.body
		}
		if err := tw.WriteHeader(h); err != nil {
			t.Fatal(err)
		}
		if typ == tar.TypeReg {
			tw.Write([]byte(e.body))
		}
	}
	tw.Close()
	gz.Close()
	desc := ocispec.Descriptor{MediaType: ocispec.MediaTypeImageLayerGzip, Digest: digest.FromBytes(buf.Bytes()), Size: int64(buf.Len())}
	if err := content.WriteBlob(context.Background(), cs, desc.Digest.String(), bytes.NewReader(buf.Bytes()), desc); err != nil {
		t.Fatal(err)
	}
	return desc
}

// TestLayerFiles: files of an image's rootfs read from its layers as the
// container sees them: the top layer's version, gone under a whiteout (of
// the file or a parent) or an opaque directory, symlinks not followed.
func TestLayerFiles(t *testing.T) {
	cs, err := local.NewStore(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	base := layer(t, cs,
		entry{name: "etc/", typ: tar.TypeDir},
		entry{name: "etc/passwd", body: "root:x:0:0::/root:/bin/sh\n"},
		entry{name: "etc/group", body: "root:x:0:\n"},
		entry{name: "etc/shadow", body: "old"},
		entry{name: "opt/app/conf", body: "old"},
		entry{name: "var/lib/x", body: "old"},
		entry{name: "etc/hostname", body: "old"},
	)
	mid := layer(t, cs,
		entry{name: "./etc/passwd", body: "root:x:0:0::/root:/bin/sh\napp:x:1000:1000::/home/app:/bin/sh\n"},
		entry{name: "etc/.wh.shadow", typ: tar.TypeReg},
		entry{name: "opt/.wh..wh..opq", typ: tar.TypeReg},
		entry{name: "var/.wh.lib", typ: tar.TypeReg},
	)
	top := layer(t, cs,
		entry{name: "etc/hostname", typ: tar.TypeSymlink, body: "/proc/sys/kernel/hostname"},
		entry{name: "unrelated", body: "x"},
	)
	got, err := layerFiles(context.Background(), cs, []ocispec.Descriptor{base, mid, top},
		[]string{"/etc/passwd", "/etc/group", "/etc/shadow", "/opt/app/conf", "/var/lib/x", "/etc/hostname", "/nope"})
	if err != nil {
		t.Fatal(err)
	}
	want := map[string]string{
		"/etc/passwd": "root:x:0:0::/root:/bin/sh\napp:x:1000:1000::/home/app:/bin/sh\n",
		"/etc/group":  "root:x:0:\n",
	}
	if len(got) != len(want) {
		t.Errorf("got %d files: %q", len(got), got)
	}
	for p, w := range want {
		if string(got[p]) != w {
			t.Errorf("%s = %q, want %q", p, got[p], w)
		}
	}
}
