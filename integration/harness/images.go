package harness

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"sync"

	"github.com/containerd/containerd/v2/client"
	"github.com/containerd/errdefs"
	"github.com/containerd/platforms"
)

// Image references of the test images built by scripts/images.sh.
const (
	BusyboxImage = "localhost/lazyfork/busybox:latest"
	PythonImage  = "localhost/lazyfork/python:latest"
	NodeImage    = "localhost/lazyfork/node:latest"
)

// ImageRef maps a short image name ("busybox", "python", "node") to its reference.
func ImageRef(name string) (string, error) {
	switch name {
	case "busybox":
		return BusyboxImage, nil
	case "python":
		return PythonImage, nil
	case "node":
		return NodeImage, nil
	}
	return "", fmt.Errorf("harness: unknown test image %q (want busybox, python or node): %w", name, errdefs.ErrInvalidArgument)
}

// RepoRoot is the LazyFork source tree: $LAZYFORK_REPO, or found from this file.
func RepoRoot() (string, error) {
	if r := os.Getenv("LAZYFORK_REPO"); r != "" {
		return r, nil
	}
	_, file, _, ok := runtime.Caller(0)
	if !ok {
		return "", fmt.Errorf("harness: cannot locate source tree; set LAZYFORK_REPO: %w", errdefs.ErrNotFound)
	}
	root := filepath.Clean(filepath.Join(filepath.Dir(file), "..", ".."))
	if _, err := os.Stat(filepath.Join(root, "scripts", "images.sh")); err != nil {
		return "", fmt.Errorf("harness: %s has no scripts/images.sh; set LAZYFORK_REPO: %w", root, errdefs.ErrNotFound)
	}
	return root, nil
}

var ensureMu sync.Mutex // one images.sh at a time per process (the script also locks)

// EnsureImage builds the image archive with scripts/images.sh if it is missing or
// stale (a cached re-run takes well under a second) and returns its path.
func EnsureImage(ctx context.Context, name string) (string, error) {
	if _, err := ImageRef(name); err != nil {
		return "", err
	}
	return imageArchive(ctx, name)
}

// imageArchive runs scripts/images.sh for any image it knows (the pause image
// included) and returns the archive's path.
func imageArchive(ctx context.Context, name string) (string, error) {
	root, err := RepoRoot()
	if err != nil {
		return "", err
	}
	ensureMu.Lock()
	defer ensureMu.Unlock()
	var stdout, stderr bytes.Buffer
	cmd := exec.CommandContext(ctx, "bash", filepath.Join(root, "scripts", "images.sh"), "--print-path", name)
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	if err := cmd.Run(); err != nil {
		return "", fmt.Errorf("harness: scripts/images.sh %s: %w\n%s", name, err, stderr.String())
	}
	lines := strings.Split(strings.TrimSpace(stdout.String()), "\n")
	path := strings.TrimSpace(lines[len(lines)-1])
	if _, err := os.Stat(path); err != nil {
		return "", fmt.Errorf("harness: images.sh printed %q: %w", path, err)
	}
	return path, nil
}

// ImportOpt changes ImportImage.
type ImportOpt func(*importConfig)

type importConfig struct{ snapshotter string }

// WithSnapshotter unpacks the image into the named snapshotter (e.g. a proxy).
func WithSnapshotter(name string) ImportOpt {
	return func(c *importConfig) { c.snapshotter = name }
}

// ImportImage imports test image name ("busybox" or "python") into the harness's
// namespace from its cached archive (building it if needed) and unpacks it.
func (c *Containerd) ImportImage(ctx context.Context, name string, opts ...ImportOpt) (client.Image, error) {
	var cfg importConfig
	for _, o := range opts {
		o(&cfg)
	}
	ref, err := ImageRef(name)
	if err != nil {
		return nil, err
	}
	path, err := EnsureImage(ctx, name)
	if err != nil {
		return nil, err
	}
	ctx = c.Context(ctx)
	f, err := os.Open(path)
	if err != nil {
		return nil, fmt.Errorf("harness: %w", err)
	}
	defer f.Close()
	cl := c.Client()
	if _, err := cl.Import(ctx, f, client.WithImportPlatform(platforms.Default())); err != nil {
		return nil, fmt.Errorf("harness: import %s: %w", path, err)
	}
	img, err := cl.GetImage(ctx, ref)
	if err != nil {
		return nil, fmt.Errorf("harness: %s not in %s: %w", ref, path, err)
	}
	img = client.NewImageWithPlatform(cl, img.Metadata(), platforms.Default())
	sn := cfg.snapshotter
	if sn == "" {
		sn = "overlayfs"
	}
	if err := img.Unpack(ctx, sn); err != nil {
		return nil, fmt.Errorf("harness: unpack %s into %s: %w", ref, sn, err)
	}
	return img, nil
}
