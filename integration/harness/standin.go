package harness

import (
	"archive/tar"
	"bytes"
	"compress/gzip"
	"context"
	"crypto/sha256"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"os"
	"path"
	"sort"
	"strings"

	"github.com/containerd/errdefs"
	"github.com/opencontainers/go-digest"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"
)

// StandIn is an image pushed under other names than its own: a cached test
// image ("busybox", "pause") with its config edited and, optionally, files
// added in one layer of their own. It stands in for an image of the internet
// (e.g. what the CRI validation suite pulls) that cannot be fetched here.
type StandIn struct {
	// Base is the test image: "busybox", "python" or "pause".
	Base string
	// Refs are the full references it is pushed as, e.g.
	// "registry.k8s.io/e2e-test-images/busybox:1.29-2". The host only tells
	// which hosts.toml must send it here (WriteHostsDir); the registry keeps
	// repository and tag.
	Refs []string
	// Files are added in one extra layer: path -> content (mode 0644, parent
	// directories created 0755). Paths ending in "/" are directories.
	Files map[string]string
	// Modes overrides the mode of some Files, e.g. 0o755 for a script,
	// 0o4755 for a setuid-root program.
	Modes map[string]int64
	// Edit changes the image config (user, command, ...), if set.
	Edit func(*ocispec.ImageConfig)
}

// imageArchiveBlobs reads an OCI archive written by scripts/images.sh: its one
// manifest and every blob.
func imageArchiveBlobs(archive string) (ocispec.Manifest, ocispec.Descriptor, map[string][]byte, error) {
	var m ocispec.Manifest
	var md ocispec.Descriptor
	f, err := os.Open(archive)
	if err != nil {
		return m, md, nil, fmt.Errorf("harness: %w", err)
	}
	defer f.Close()
	blobs := map[string][]byte{}
	var index ocispec.Index
	tr := tar.NewReader(f)
	for {
		h, err := tr.Next()
		if err == io.EOF {
			break
		}
		if err != nil {
			return m, md, nil, fmt.Errorf("harness: read %s: %w", archive, err)
		}
		b, err := io.ReadAll(tr)
		if err != nil {
			return m, md, nil, fmt.Errorf("harness: read %s: %w", archive, err)
		}
		switch p := strings.TrimPrefix(h.Name, "./"); {
		case p == "index.json":
			if err := json.Unmarshal(b, &index); err != nil {
				return m, md, nil, fmt.Errorf("harness: %s index.json: %w", archive, err)
			}
		case strings.HasPrefix(p, "blobs/sha256/") && h.Typeflag == tar.TypeReg:
			blobs["sha256:"+strings.TrimPrefix(p, "blobs/sha256/")] = b
		}
	}
	if len(index.Manifests) != 1 {
		return m, md, nil, fmt.Errorf("harness: %s has %d manifests, want 1: %w", archive, len(index.Manifests), errdefs.ErrInvalidArgument)
	}
	md = index.Manifests[0]
	mb, ok := blobs[md.Digest.String()]
	if !ok {
		return m, md, nil, fmt.Errorf("harness: %s lacks its manifest %s: %w", archive, md.Digest, errdefs.ErrNotFound)
	}
	if err := json.Unmarshal(mb, &m); err != nil {
		return m, md, nil, fmt.Errorf("harness: manifest of %s: %w", archive, err)
	}
	return m, md, blobs, nil
}

// filesLayer packs files into a gzipped tar layer; it returns the layer and
// the digest of its uncompressed tar (the config's diff_id).
func filesLayer(files map[string]string, modes map[string]int64) (layer []byte, diffID digest.Digest, _ error) {
	var raw bytes.Buffer
	tw := tar.NewWriter(&raw)
	dirs := map[string]bool{}
	var names []string
	for p := range files {
		names = append(names, p)
	}
	sort.Strings(names)
	addDir := func(d string) error {
		var parts []string
		for _, s := range strings.Split(strings.Trim(d, "/"), "/") {
			parts = append(parts, s)
			p := strings.Join(parts, "/") + "/"
			if p == "/" || dirs[p] {
				continue
			}
			dirs[p] = true
			if err := tw.WriteHeader(&tar.Header{Name: p, Typeflag: tar.TypeDir, Mode: 0o755}); err != nil {
				return err
			}
		}
		return nil
	}
	for _, p := range names {
		name := strings.TrimPrefix(path.Clean("/"+p), "/")
		if strings.HasSuffix(p, "/") {
			if err := addDir(name); err != nil {
				return nil, "", err
			}
			continue
		}
		if d := path.Dir(name); d != "." {
			if err := addDir(d); err != nil {
				return nil, "", err
			}
		}
		mode := int64(0o644)
		if m, ok := modes[p]; ok {
			mode = m
		}
		if err := tw.WriteHeader(&tar.Header{Name: name, Typeflag: tar.TypeReg, Mode: mode, Size: int64(len(files[p]))}); err != nil {
			return nil, "", err
		}
		if _, err := tw.Write([]byte(files[p])); err != nil {
			return nil, "", err
		}
	}
	if err := tw.Close(); err != nil {
		return nil, "", err
	}
	var gz bytes.Buffer
	zw := gzip.NewWriter(&gz)
	if _, err := zw.Write(raw.Bytes()); err != nil {
		return nil, "", err
	}
	if err := zw.Close(); err != nil {
		return nil, "", err
	}
	return gz.Bytes(), digest.FromBytes(raw.Bytes()), nil
}

// PushStandIn builds s from its base archive and pushes it under each of its
// references; it returns the manifest digest (the same for every reference).
func (r *Registry) PushStandIn(ctx context.Context, s StandIn) (digest.Digest, error) {
	archive, err := imageArchive(ctx, s.Base)
	if err != nil {
		return "", err
	}
	m, _, blobs, err := imageArchiveBlobs(archive)
	if err != nil {
		return "", err
	}
	var img ocispec.Image
	if err := json.Unmarshal(blobs[m.Config.Digest.String()], &img); err != nil {
		return "", fmt.Errorf("harness: config of %s: %w", archive, err)
	}
	layers := append([]ocispec.Descriptor(nil), m.Layers...)
	if len(s.Files) > 0 {
		layer, diffID, err := filesLayer(s.Files, s.Modes)
		if err != nil {
			return "", fmt.Errorf("harness: stand-in layer: %w", err)
		}
		d := ocispec.Descriptor{MediaType: ocispec.MediaTypeImageLayerGzip, Digest: digest.FromBytes(layer), Size: int64(len(layer))}
		blobs[d.Digest.String()] = layer
		layers = append(layers, d)
		img.RootFS.DiffIDs = append(img.RootFS.DiffIDs, diffID)
	}
	if s.Edit != nil {
		s.Edit(&img.Config)
	}
	cb, err := json.Marshal(img)
	if err != nil {
		return "", err
	}
	cd := ocispec.Descriptor{MediaType: ocispec.MediaTypeImageConfig, Digest: digest.FromBytes(cb), Size: int64(len(cb))}
	blobs[cd.Digest.String()] = cb
	m.Config, m.Layers = cd, layers
	m.MediaType = ocispec.MediaTypeImageManifest
	mb, err := json.Marshal(m)
	if err != nil {
		return "", err
	}
	for _, ref := range s.Refs {
		repo, tag, err := splitRef(ref)
		if err != nil {
			return "", err
		}
		for _, d := range append([]ocispec.Descriptor{cd}, layers...) {
			if err := r.do(ctx, http.MethodPost, "/v2/"+repo+"/blobs/uploads/?digest="+d.Digest.String(), "application/octet-stream", blobs[d.Digest.String()], http.StatusCreated); err != nil {
				return "", err
			}
		}
		if err := r.do(ctx, http.MethodPut, "/v2/"+repo+"/manifests/"+tag, ocispec.MediaTypeImageManifest, mb, http.StatusCreated); err != nil {
			return "", err
		}
	}
	sum := sha256.Sum256(mb)
	return digest.NewDigestFromBytes(digest.SHA256, sum[:]), nil
}

// splitRef splits HOST/REPO[:TAG][@DIGEST] into the registry's repository and
// tag ("latest" when none; a digest-only reference is pushed as "latest": its
// digest cannot be made to match).
func splitRef(ref string) (repo, tag string, _ error) {
	i := strings.Index(ref, "/")
	if i < 0 {
		return "", "", fmt.Errorf("harness: reference %q has no host: %w", ref, errdefs.ErrInvalidArgument)
	}
	rest := ref[i+1:]
	if j := strings.Index(rest, "@"); j >= 0 {
		rest = rest[:j]
	}
	tag = "latest"
	if j := strings.LastIndex(rest, ":"); j >= 0 {
		rest, tag = rest[:j], rest[j+1:]
	}
	return rest, tag, nil
}
