package client

import (
	"bytes"
	"context"
	"encoding/base64"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/containerd/containerd/v2/core/transfer"
	"github.com/containerd/errdefs"
)

func TestNormalizeImageRef(t *testing.T) {
	for in, want := range map[string]string{
		"python:3.12-slim":                         "docker.io/library/python:3.12-slim",
		"busybox":                                  "docker.io/library/busybox:latest",
		"user/app":                                 "docker.io/user/app:latest",
		"docker.io/library/python:3.12":            "docker.io/library/python:3.12",
		"ghcr.io/org/app:v1":                       "ghcr.io/org/app:v1",
		"localhost/lazyfork/busybox:latest":        "localhost/lazyfork/busybox:latest",
		"127.0.0.1:5000/x":                         "127.0.0.1:5000/x:latest",
		"python@sha256:" + strings.Repeat("a", 64): "docker.io/library/python@sha256:" + strings.Repeat("a", 64),
	} {
		got, err := NormalizeImageRef(in)
		if err != nil || got != want {
			t.Errorf("NormalizeImageRef(%q) = %q, %v; want %q", in, got, err, want)
		}
	}
	for _, bad := range []string{"", "UPPERCASE", "a:b:c", "python:bad tag"} {
		if _, err := NormalizeImageRef(bad); !errdefs.IsInvalidArgument(err) {
			t.Errorf("NormalizeImageRef(%q): %v, want invalid argument", bad, err)
		}
	}
}

func TestParsePullPolicy(t *testing.T) {
	for in, want := range map[string]PullPolicy{"": PullMissing, "missing": PullMissing, "always": PullAlways, "never": PullNever} {
		if got, err := ParsePullPolicy(in); err != nil || got != want {
			t.Errorf("ParsePullPolicy(%q) = %q, %v", in, got, err)
		}
	}
	if _, err := ParsePullPolicy("sometimes"); !errdefs.IsInvalidArgument(err) || !strings.Contains(err.Error(), "missing, always or never") {
		t.Errorf("ParsePullPolicy(sometimes): %v", err)
	}
}

func TestHostsDirFor(t *testing.T) {
	a, b := t.TempDir(), t.TempDir()
	for _, d := range []string{filepath.Join(a, "ghcr.io"), filepath.Join(b, "docker.io"), filepath.Join(b, "reg.local_5000_")} {
		if err := os.MkdirAll(d, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	roots := []string{"", filepath.Join(a, "missing"), a, b}
	for host, want := range map[string]string{"docker.io": b, "ghcr.io": a, "reg.local:5000": b, "quay.io": ""} {
		if got := hostsDirFor(roots, host); got != want {
			t.Errorf("hostsDirFor(%s) = %q, want %q", host, got, want)
		}
	}
	if err := os.MkdirAll(filepath.Join(a, "_default"), 0o755); err != nil {
		t.Fatal(err)
	}
	// The first root with anything for the host wins, as in CRI.
	if got := hostsDirFor(roots, "docker.io"); got != a {
		t.Errorf("with %s/_default: hostsDirFor(docker.io) = %q", a, got)
	}
}

func TestReadContainerdConfig(t *testing.T) {
	dir := t.TempDir()
	write := func(name, text string) string {
		p := filepath.Join(dir, name)
		if err := os.WriteFile(p, []byte(text), 0o600); err != nil {
			t.Fatal(err)
		}
		return p
	}
	for _, c := range []struct {
		text, addr string
		dirs       []string
	}{
		{"version = 3\n[grpc]\n  address = \"/tmp/x/c.sock\"\n[plugins]\n  [plugins.'io.containerd.transfer.v1.local']\n    config_path = \"/etc/a:/etc/b\"\n",
			"/tmp/x/c.sock", []string{"/etc/a", "/etc/b"}},
		{"version = 3\n[plugins.'io.containerd.cri.v1.images'.registry]\n  config_path = \"/etc/containerd/certs.d\"\n",
			"/run/containerd/containerd.sock", []string{"/etc/containerd/certs.d"}},
		{"version = 2\n[plugins.\"io.containerd.grpc.v1.cri\".registry]\n  config_path = \"/v2/certs.d\"\n",
			"/run/containerd/containerd.sock", []string{"/v2/certs.d"}},
		{"version = 3\n", "/run/containerd/containerd.sock", nil},
	} {
		addr, dirs, ok := readContainerdConfig(write("config.toml", c.text))
		if !ok || addr != c.addr || strings.Join(dirs, ",") != strings.Join(c.dirs, ",") {
			t.Errorf("readContainerdConfig(%q) = %q %q %v; want %q %q", c.text, addr, dirs, ok, c.addr, c.dirs)
		}
	}
	if _, _, ok := readContainerdConfig(write("bad.toml", "[[[")); ok {
		t.Errorf("a config that does not parse was read")
	}
	for args, want := range map[string]string{
		"":                             DefaultContainerdConfig,
		"--config /a.toml":             "/a.toml",
		"-c /b.toml":                   "/b.toml",
		"--log-level debug -c=/c.toml": "/c.toml",
		"--config=/d.toml":             "/d.toml",
	} {
		if got := configArg(strings.Fields(args)); got != want {
			t.Errorf("configArg(%q) = %q, want %q", args, got, want)
		}
	}
}

func TestDockerCredentials(t *testing.T) {
	dir := t.TempDir()
	b64 := func(s string) string { return base64.StdEncoding.EncodeToString([]byte(s)) }
	helperDir := t.TempDir()
	helper := "#!/bin/sh\nread server\necho \"{\\\"ServerURL\\\":\\\"$server\\\",\\\"Username\\\":\\\"helper-user\\\",\\\"Secret\\\":\\\"for-$server\\\"}\"\n"
	if err := os.WriteFile(filepath.Join(helperDir, "docker-credential-test"), []byte(helper), 0o755); err != nil {
		t.Fatal(err)
	}
	t.Setenv("PATH", helperDir+":"+os.Getenv("PATH"))
	cfg := `{
  "auths": {
    "https://index.docker.io/v1/": {"auth": "` + b64("hubuser:hubpass") + `"},
    "http://127.0.0.1:5000": {"auth": "` + b64("alice:s3:cret") + `"},
    "ghcr.io": {"username": "bob", "password": "pw"},
    "quay.io": {"identitytoken": "refresh-me"}
  },
  "credHelpers": {"helped.example": "test"}
}`
	if err := os.WriteFile(filepath.Join(dir, "config.json"), []byte(cfg), 0o600); err != nil {
		t.Fatal(err)
	}
	d := &dockerCredentials{dir: dir}
	ctx := context.Background()
	for host, want := range map[string][2]string{
		"registry-1.docker.io": {"hubuser", "hubpass"},
		"docker.io":            {"hubuser", "hubpass"},
		"127.0.0.1:5000":       {"alice", "s3:cret"},
		"ghcr.io":              {"bob", "pw"},
		"quay.io":              {"", "refresh-me"},
		"helped.example":       {"helper-user", "for-helped.example"},
		"other.example":        {"", ""},
	} {
		c, err := d.GetCredentials(ctx, "ref", host)
		if err != nil || c.Username != want[0] || c.Secret != want[1] {
			t.Errorf("credentials for %s: %q/%q %v; want %q", host, c.Username, c.Secret, err, want)
		}
	}
	if h := d.hint("other.example"); !strings.Contains(h, "has no credentials for other.example") {
		t.Errorf("hint after a host without credentials: %s", h)
	}
	// No file, or a bad one: anonymous, never an error.
	for _, text := range []string{"", "{not json"} {
		dir := t.TempDir()
		if text != "" {
			_ = os.WriteFile(filepath.Join(dir, "config.json"), []byte(text), 0o600)
		}
		c, err := (&dockerCredentials{dir: dir}).GetCredentials(ctx, "ref", "docker.io")
		if err != nil || c.Username != "" || c.Secret != "" {
			t.Errorf("config %q: %+v %v", text, c, err)
		}
	}
	t.Setenv("DOCKER_CONFIG", "/some/where")
	if f := (&dockerCredentials{}).file(); f != "/some/where/config.json" {
		t.Errorf("with $DOCKER_CONFIG: %s", f)
	}
}

func TestClassifyPullError(t *testing.T) {
	creds := &dockerCredentials{dir: "/cfg"}
	for msg, c := range map[string]struct {
		kind  string
		class error
	}{
		"failed to resolve image: docker.io/library/python:nosuch: not found":                                                         {"not found", errdefs.ErrNotFound},
		"failed to copy: httpReadSeeker: failed open: could not fetch content descriptor sha256:ab (layer) from remote: not found":    {"not found", errdefs.ErrNotFound},
		`failed to do request: Head "http://127.0.0.1:1/v2/app/manifests/1": dial tcp 127.0.0.1:1: connect: connection refused`:       {"network", errdefs.ErrUnavailable},
		`failed to do request: Head "https://x.invalid/v2/": dial tcp: lookup x.invalid on 10.0.0.1:53: no such host`:                 {"name resolution", errdefs.ErrUnavailable},
		"pull access denied, repository does not exist or may require authorization: authorization failed: no basic auth credentials": {"authentication", errdefs.ErrUnauthenticated},
		"unexpected media type": {"pull", nil},
	} {
		err := classifyPullError("r", "docker.io", "/hosts", creds, errors.New(msg))
		var pe *PullError
		if !errors.As(err, &pe) || pe.Kind != c.kind {
			t.Errorf("%q: %v, want kind %q", msg, err, c.kind)
			continue
		}
		if c.class != nil && !errors.Is(err, c.class) {
			t.Errorf("%q: %v is not %v", msg, err, c.class)
		}
		if !strings.HasPrefix(err.Error(), "pull r: "+c.kind+": "+msg) {
			t.Errorf("message: %s", err)
		}
	}
	if err := classifyPullError("r", "h", "", creds, context.Canceled); !errors.Is(err, context.Canceled) {
		t.Errorf("canceled: %v", err)
	}
}

func TestPullProgress(t *testing.T) {
	var tty, plain bytes.Buffer
	for _, c := range []struct {
		buf      *bytes.Buffer
		terminal bool
	}{{&tty, true}, {&plain, false}} {
		p := newPullProgress(c.buf, c.terminal, "docker.io/library/x:1", "registry docker.io")
		p.update(transfer.Progress{Event: "Resolving from OCI Registry"})
		p.update(transfer.Progress{Event: "waiting", Name: "layer-sha256:0123456789abcdef", Total: 100})
		p.update(transfer.Progress{Event: "downloading", Name: "layer-sha256:0123456789abcdef", Progress: 50, Total: 100})
		p.update(transfer.Progress{Event: "complete", Name: "layer-sha256:0123456789abcdef", Progress: 100, Total: 100})
		p.finish(nil, 1500*time.Millisecond)
		p.update(transfer.Progress{Event: "late", Name: "layer-sha256:ffff"}) // after finish: ignored
	}
	for _, want := range []string{"docker.io/library/x:1: pulling from registry docker.io\n", "layer 0123456789ab: downloading",
		"50.0 B/100.0 B", "layer 0123456789ab: complete", "\x1b[1A\x1b[2K", "done   elapsed: ", "pulled 1 blobs, 100.0 B in 1.5s\n"} {
		if !strings.Contains(tty.String(), want) {
			t.Errorf("terminal progress lacks %q:\n%q", want, tty.String())
		}
	}
	if want := "docker.io/library/x:1: pulling from registry docker.io\ndocker.io/library/x:1: pulled 1 blobs, 100.0 B in 1.5s\n"; plain.String() != want {
		t.Errorf("progress without a terminal:\n%q\nwant\n%q", plain.String(), want)
	}
}
