package integration

import (
	"archive/tar"
	"bytes"
	"context"
	"encoding/json"
	"testing"

	containerd "github.com/containerd/containerd/v2/client"
	"github.com/containerd/containerd/v2/core/content"
	"github.com/containerd/containerd/v2/core/images"
	"github.com/containerd/platforms"
	"github.com/opencontainers/go-digest"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"
)

// userImage makes image name from base plus a layer with /etc/passwd and
// /etc/group naming user app (uid 1234, also in group extra, 777), which
// its config runs as, and unpacks it into snapshotter. The test's lease
// keeps its blobs.
func userImage(t *testing.T, ctx context.Context, cd *containerd.Client, base, name, snapshotter string) {
	t.Helper()
	ctx, done, err := cd.WithLease(ctx)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { done(context.Background()) })
	cs := cd.ContentStore()
	bimg, err := cd.GetImage(ctx, base)
	if err != nil {
		t.Fatal(err)
	}
	m, err := images.Manifest(ctx, cs, bimg.Target(), platforms.Default())
	if err != nil {
		t.Fatal(err)
	}
	write := func(mt string, b []byte) ocispec.Descriptor {
		d := ocispec.Descriptor{MediaType: mt, Digest: digest.FromBytes(b), Size: int64(len(b))}
		if err := content.WriteBlob(ctx, cs, d.Digest.String(), bytes.NewReader(b), d); err != nil {
			t.Fatal(err)
		}
		return d
	}
	var layer bytes.Buffer
	tw := tar.NewWriter(&layer)
	for _, f := range []struct{ name, body string }{
		{"etc/passwd", "root:x:0:0:root:/root:/bin/sh\napp:x:1234:1234:app:/:/bin/sh\n"},
		{"etc/group", "root:x:0:\napp:x:1234:\nextra:x:777:app\n"},
	} {
		if err := tw.WriteHeader(&tar.Header{Name: f.name, Mode: 0o644, Size: int64(len(f.body)), Typeflag: tar.TypeReg}); err != nil {
			t.Fatal(err)
		}
		tw.Write([]byte(f.body))
	}
	tw.Close()
	ld := write(ocispec.MediaTypeImageLayer, layer.Bytes())
	cb, err := content.ReadBlob(ctx, cs, m.Config)
	if err != nil {
		t.Fatal(err)
	}
	var cfg ocispec.Image
	if err := json.Unmarshal(cb, &cfg); err != nil {
		t.Fatal(err)
	}
	cfg.Config.User = "app"
	cfg.RootFS.DiffIDs = append(cfg.RootFS.DiffIDs, ld.Digest)
	cb, _ = json.Marshal(cfg)
	m.Config = write(m.Config.MediaType, cb)
	m.Layers = append(m.Layers, ld)
	mb, _ := json.Marshal(m)
	md := write(ocispec.MediaTypeImageManifest, mb)
	rec, err := cd.ImageService().Create(ctx, images.Image{Name: name, Target: md})
	if err != nil {
		t.Fatal(err)
	}
	if err := containerd.NewImage(cd, rec).Unpack(ctx, snapshotter); err != nil {
		t.Fatal(err)
	}
}
