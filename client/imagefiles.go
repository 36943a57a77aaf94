package client

import (
	"archive/tar"
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"path"
	"path/filepath"
	"strings"

	containerd "github.com/containerd/containerd/v2/client"
	"github.com/containerd/containerd/v2/core/content"
	"github.com/containerd/containerd/v2/core/images"
	"github.com/containerd/containerd/v2/pkg/archive/compression"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"
)

// maxImageFile bounds a file ImageFiles reads.
const maxImageFile = 4 << 20

// ImageFiles reads regular files of an image's root filesystem (absolute
// paths, such as /etc/passwd) from its layers in containerd's content
// store, as the container would see them: the topmost layer that has a
// path wins, and whiteouts and opaque directories hide lower layers. It
// mounts nothing, so a client on another host (a Mac driving a VM) reads
// an image as containerd's client reads it on the node by mounting its
// rootfs. A path the image lacks, or has as a symlink or directory, is not
// in the map.
func ImageFiles(ctx context.Context, img containerd.Image, paths ...string) (map[string][]byte, error) {
	m, err := images.Manifest(ctx, img.ContentStore(), img.Target(), img.Platform())
	if err != nil {
		return nil, fmt.Errorf("manifest of %s: %w", img.Name(), err)
	}
	return layerFiles(ctx, img.ContentStore(), m.Layers, paths)
}

func layerFiles(ctx context.Context, cs content.Provider, layers []ocispec.Descriptor, paths []string) (map[string][]byte, error) {
	want := map[string]string{} // clean relative path -> the caller's
	for _, p := range paths {
		want[strings.TrimPrefix(path.Clean("/"+p), "/")] = p
	}
	found := map[string][]byte{}
	for i := len(layers) - 1; i >= 0 && len(want) > 0; i-- {
		hidden, err := scanLayer(ctx, cs, layers[i], want, found)
		if err != nil {
			return nil, err
		}
		for _, p := range hidden {
			delete(want, p)
		}
	}
	return found, nil
}

// scanLayer reads layer's wanted files into found (removing them from
// want) and returns the wanted paths it hides from lower layers.
func scanLayer(ctx context.Context, cs content.Provider, layer ocispec.Descriptor, want map[string]string, found map[string][]byte) ([]string, error) {
	ra, err := cs.ReaderAt(ctx, layer)
	if err != nil {
		return nil, fmt.Errorf("layer %s: %w", layer.Digest, err)
	}
	defer ra.Close()
	ds, err := compression.DecompressStream(content.NewReader(ra))
	if err != nil {
		return nil, fmt.Errorf("layer %s: %w", layer.Digest, err)
	}
	defer ds.Close()
	tr := tar.NewReader(ds)
	var hidden []string
	for len(want) > 0 {
		hdr, err := tr.Next()
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			return nil, fmt.Errorf("layer %s: %w", layer.Digest, err)
		}
		name := strings.TrimPrefix(path.Clean("/"+hdr.Name), "/")
		dir, base := path.Split(name)
		for p, orig := range want {
			switch {
			case name == p:
				delete(want, p)
				if hdr.Typeflag != tar.TypeReg {
					continue // a symlink or directory: not followed
				}
				if hdr.Size > maxImageFile {
					return nil, fmt.Errorf("%s in layer %s: %d bytes, more than %d", orig, layer.Digest, hdr.Size, maxImageFile)
				}
				b, err := io.ReadAll(io.LimitReader(tr, maxImageFile))
				if err != nil {
					return nil, fmt.Errorf("%s in layer %s: %w", orig, layer.Digest, err)
				}
				found[orig] = b
			case base == ".wh..wh..opq" && strings.HasPrefix(p, dir):
				hidden = append(hidden, p) // an opaque directory above p
			case strings.HasPrefix(base, ".wh.") && hides(dir+strings.TrimPrefix(base, ".wh."), p):
				hidden = append(hidden, p)
			}
		}
	}
	return hidden, nil
}

// hides reports whether removing path gone removes p (p or a parent).
func hides(gone, p string) bool {
	return p == gone || strings.HasPrefix(p, gone+"/")
}

// WriteImageUserFiles writes the image's /etc/passwd and /etc/group (those
// it has) under dir, read from its layers (ImageFiles): for containerd's
// oci.WithUser and WithAdditionalGIDs on a client that cannot mount the
// image.
func WriteImageUserFiles(ctx context.Context, img containerd.Image, dir string) error {
	files, err := ImageFiles(ctx, img, "/etc/passwd", "/etc/group")
	if err != nil {
		return err
	}
	if err := os.MkdirAll(filepath.Join(dir, "etc"), 0o755); err != nil {
		return err
	}
	for p, b := range files {
		if err := os.WriteFile(filepath.Join(dir, p), b, 0o644); err != nil {
			return err
		}
	}
	return nil
}
