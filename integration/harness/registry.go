package harness

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"io/fs"
	"log"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"time"

	"github.com/containerd/errdefs"
	ggcrregistry "github.com/google/go-containerregistry/pkg/registry"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"
)

// Registry is an in-memory OCI registry (go-containerregistry's) on
// 127.0.0.1 over plain HTTP, for pulls without the internet: PushImage puts
// a test image under any repository and tag, and HostsDir writes the
// hosts.toml that sends a registry host (docker.io, ...) to it.
type Registry struct {
	// Host is host:port of the registry.
	Host string

	srv *http.Server
	ln  net.Listener

	mu       sync.Mutex
	user     string // basic auth when set
	pass     string
	missing  map[string]bool // blob digests answered 404
	rate     int             // bytes per second of blob downloads; 0: no limit
	requests []string        // "METHOD path" of every request
}

// StartRegistry serves an empty registry until Close.
func StartRegistry() (*Registry, error) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, fmt.Errorf("harness: registry listen: %w", err)
	}
	r := &Registry{Host: ln.Addr().String(), ln: ln, missing: map[string]bool{}}
	inner := ggcrregistry.New(ggcrregistry.Logger(log.New(io.Discard, "", 0)))
	r.srv = &http.Server{Handler: http.HandlerFunc(func(w http.ResponseWriter, req *http.Request) {
		r.mu.Lock()
		r.requests = append(r.requests, req.Method+" "+req.URL.Path)
		user, pass, rate := r.user, r.pass, r.rate
		var gone bool
		for d := range r.missing {
			if strings.HasSuffix(req.URL.Path, "/blobs/"+d) {
				gone = true
			}
		}
		r.mu.Unlock()
		if user != "" {
			if u, p, ok := req.BasicAuth(); !ok || u != user || p != pass {
				w.Header().Set("WWW-Authenticate", `Basic realm="lazyfork-test"`)
				http.Error(w, `{"errors":[{"code":"UNAUTHORIZED","message":"authentication required"}]}`, http.StatusUnauthorized)
				return
			}
		}
		if gone && req.Method != http.MethodPut && req.Method != http.MethodPost && req.Method != http.MethodPatch {
			http.Error(w, `{"errors":[{"code":"BLOB_UNKNOWN","message":"blob unknown"}]}`, http.StatusNotFound)
			return
		}
		if rate > 0 && req.Method == http.MethodGet && strings.Contains(req.URL.Path, "/blobs/") {
			w = &slowWriter{ResponseWriter: w, chunk: rate / 10}
		}
		inner.ServeHTTP(w, req)
	})}
	go func() { _ = r.srv.Serve(ln) }()
	return r, nil
}

// Close stops the registry.
func (r *Registry) Close() error { return r.srv.Close() }

// RequireBasicAuth makes every request need user:pass (a 401 with a Basic
// challenge otherwise); "" turns it off.
func (r *Registry) RequireBasicAuth(user, pass string) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.user, r.pass = user, pass
}

// LimitRate slows blob downloads to bytesPerSecond (0: no limit), so that
// a pull lasts long enough to show its progress.
func (r *Registry) LimitRate(bytesPerSecond int) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.rate = bytesPerSecond
}

// slowWriter writes at most chunk bytes per tenth of a second.
type slowWriter struct {
	http.ResponseWriter
	chunk int
}

func (s *slowWriter) Write(p []byte) (int, error) {
	n := 0
	for len(p) > 0 {
		k := min(len(p), s.chunk)
		m, err := s.ResponseWriter.Write(p[:k])
		n += m
		if err != nil {
			return n, err
		}
		p = p[k:]
		if f, ok := s.ResponseWriter.(http.Flusher); ok {
			f.Flush()
		}
		time.Sleep(100 * time.Millisecond)
	}
	return n, nil
}

// DropBlob makes the registry answer 404 for blob digest (sha256:...) as
// if it had lost it; uploads still work.
func (r *Registry) DropBlob(digest string) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.missing[digest] = true
}

// Requests returns "METHOD path" of every request so far.
func (r *Registry) Requests() []string {
	r.mu.Lock()
	defer r.mu.Unlock()
	return append([]string(nil), r.requests...)
}

// PushImage uploads test image name ("busybox", "python") from its cached
// OCI archive as repo:tag, e.g. "library/python", "3.12-slim", and returns
// the image manifest and its descriptor.
func (r *Registry) PushImage(ctx context.Context, name, repo, tag string) (m ocispec.Manifest, md ocispec.Descriptor, _ error) {
	path, err := EnsureImage(ctx, name)
	if err != nil {
		return m, md, err
	}
	m, md, blobs, err := imageArchiveBlobs(path)
	if err != nil {
		return m, md, err
	}
	mb := blobs[md.Digest.String()]
	for _, d := range append([]ocispec.Descriptor{m.Config}, m.Layers...) {
		b, ok := blobs[d.Digest.String()]
		if !ok {
			return m, md, fmt.Errorf("harness: %s lacks blob %s: %w", path, d.Digest, errdefs.ErrNotFound)
		}
		if err := r.do(ctx, http.MethodPost, "/v2/"+repo+"/blobs/uploads/?digest="+d.Digest.String(), "application/octet-stream", b, http.StatusCreated); err != nil {
			return m, md, err
		}
	}
	mt := md.MediaType
	if mt == "" {
		mt = ocispec.MediaTypeImageManifest
	}
	return m, md, r.do(ctx, http.MethodPut, "/v2/"+repo+"/manifests/"+tag, mt, mb, http.StatusCreated)
}

func (r *Registry) do(ctx context.Context, method, path, contentType string, body []byte, want int) error {
	req, err := http.NewRequestWithContext(ctx, method, "http://"+r.Host+path, bytes.NewReader(body))
	if err != nil {
		return fmt.Errorf("harness: %w", err)
	}
	req.Header.Set("Content-Type", contentType)
	r.mu.Lock()
	if r.user != "" {
		req.SetBasicAuth(r.user, r.pass)
	}
	r.mu.Unlock()
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return fmt.Errorf("harness: registry %s %s: %w", method, path, err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != want {
		msg, _ := io.ReadAll(resp.Body)
		return fmt.Errorf("harness: registry %s %s: %s: %s", method, path, resp.Status, msg)
	}
	return nil
}

// WriteHostsDir writes dir/HOST/hosts.toml for each registry host (e.g.
// "docker.io") so that containerd pulls it from server (http://host:port,
// tried as a mirror, then as the upstream: nothing leaves this machine).
// dir is what containerd's config_path names.
func WriteHostsDir(dir, server string, hosts ...string) error {
	for _, h := range hosts {
		d := filepath.Join(dir, h)
		if err := os.MkdirAll(d, 0o755); err != nil {
			return fmt.Errorf("harness: %w", err)
		}
		cfg := fmt.Sprintf("# %s through the test registry (no internet here)\nserver = %q\n\n[host.%q]\n  capabilities = [\"pull\", \"resolve\"]\n", h, server, server)
		if err := os.WriteFile(filepath.Join(d, "hosts.toml"), []byte(cfg), fs.FileMode(0o644)); err != nil {
			return fmt.Errorf("harness: %w", err)
		}
	}
	return nil
}
