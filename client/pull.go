package client

import (
	"context"
	"errors"
	"fmt"
	"io"
	"strings"
	"time"

	containerd "github.com/containerd/containerd/v2/client"
	"github.com/containerd/containerd/v2/core/images"
	"github.com/containerd/containerd/v2/core/leases"
	"github.com/containerd/containerd/v2/core/transfer"
	transferimage "github.com/containerd/containerd/v2/core/transfer/image"
	"github.com/containerd/containerd/v2/core/transfer/registry"
	"github.com/containerd/errdefs"
	"github.com/containerd/platforms"
	"github.com/distribution/reference"
)

// PullPolicy says when Image pulls, as nerdctl's --pull does.
type PullPolicy string

const (
	PullMissing PullPolicy = "missing" // pull only when containerd lacks the image (default)
	PullAlways  PullPolicy = "always"  // pull every time (a newer image under the tag replaces the old)
	PullNever   PullPolicy = "never"   // never pull: the image must be in containerd
)

// ParsePullPolicy checks a --pull value ("" is missing).
func ParsePullPolicy(s string) (PullPolicy, error) {
	switch p := PullPolicy(s); p {
	case "":
		return PullMissing, nil
	case PullMissing, PullAlways, PullNever:
		return p, nil
	}
	return "", fmt.Errorf("--pull %q: want missing, always or never: %w", s, errdefs.ErrInvalidArgument)
}

// NormalizeImageRef resolves a short image name as nerdctl and docker do:
// python:3.12-slim is docker.io/library/python:3.12-slim, user/app is
// docker.io/user/app:latest; a name with a registry host (a dot, a port or
// localhost before the first slash) keeps it.
func NormalizeImageRef(ref string) (string, error) {
	named, err := reference.ParseDockerRef(ref)
	if err != nil {
		return "", fmt.Errorf("image name %q: %v: %w", ref, err, errdefs.ErrInvalidArgument)
	}
	return named.String(), nil
}

// PullOptions configure Image and Pull. The zero value pulls a missing image
// for this machine's platform with the host's registry configuration, no
// progress, no unpack.
type PullOptions struct {
	Policy PullPolicy
	// Snapshotter, when set, is what the image is unpacked into.
	Snapshotter string
	// HostsDirs are the roots of hosts.toml directories (containerd's
	// config_path); the first holding a directory for the registry host
	// (or _default) is used. Nil means RegistryHostsDirs(Address).
	HostsDirs []string
	// Address is containerd's socket; it finds the daemon's config_path when
	// HostsDirs is nil.
	Address string
	// DockerConfig is the directory of config.json for credentials; "" means
	// $DOCKER_CONFIG, else ~/.docker (as nerdctl and docker read them).
	DockerConfig string
	// Progress receives the pull's progress (nil: none). Terminal redraws it
	// in place (a tty); otherwise a line at the start and one at the end.
	Progress io.Writer
	Terminal bool
}

// Image returns the image ref names, pulling it as o.Policy says, and
// unpacked into o.Snapshotter when that is set. ref may be short
// (python:3.12-slim); the image is looked up under ref as given, then under
// its normalized name. A failed pull leaves no image behind (the content it
// fetched is under a lease that ends with it), and neither does a failed
// unpack of an image this call pulled.
func (c *Client) Image(ctx context.Context, ref string, o PullOptions) (containerd.Image, error) {
	policy, err := ParsePullPolicy(string(o.Policy))
	if err != nil {
		return nil, err
	}
	full, err := NormalizeImageRef(ref)
	if err != nil {
		return nil, err
	}
	var img containerd.Image
	if policy != PullAlways {
		for _, name := range []string{ref, full} {
			if img, err = c.cd.GetImage(ctx, name); err == nil {
				break
			} else if !errdefs.IsNotFound(err) {
				return nil, fmt.Errorf("image %s: %w", name, err)
			}
		}
	}
	pulled := false
	if img == nil {
		if policy == PullNever {
			return nil, fmt.Errorf("image %s is not in containerd and --pull=never: pull it (--pull=missing) or import it (ctr -n NAMESPACE images import FILE): %w", full, errdefs.ErrNotFound)
		}
		existed := false
		if _, err := c.cd.ImageService().Get(ctx, full); err == nil {
			existed = true
		}
		if img, err = c.Pull(ctx, full, o); err != nil {
			return nil, err
		}
		pulled = !existed
	}
	if o.Snapshotter == "" {
		return img, nil
	}
	if ok, err := img.IsUnpacked(ctx, o.Snapshotter); err == nil && ok {
		return img, nil
	}
	if o.Progress != nil && pulled {
		fmt.Fprintf(o.Progress, "%s: unpacking into %s\n", img.Name(), o.Snapshotter)
	}
	if err := img.Unpack(ctx, o.Snapshotter); err != nil {
		if pulled {
			_ = c.cd.ImageService().Delete(context.WithoutCancel(ctx), img.Name(), images.SynchronousDelete())
		}
		return nil, fmt.Errorf("unpack %s into %s: %w", img.Name(), o.Snapshotter, err)
	}
	return img, nil
}

// Pull fetches ref (a full reference, see NormalizeImageRef) through
// containerd's transfer service, with the registry configuration of
// o.HostsDirs (hosts.toml: mirrors, TLS, plain http) and credentials from
// docker's config.json. It does not unpack. A failed transfer is a
// *PullError naming what failed; what it fetched goes with its lease.
func (c *Client) Pull(ctx context.Context, ref string, o PullOptions) (containerd.Image, error) {
	named, err := reference.ParseNormalizedNamed(ref)
	if err != nil {
		return nil, fmt.Errorf("image name %q: %v: %w", ref, err, errdefs.ErrInvalidArgument)
	}
	host := reference.Domain(named)
	roots := o.HostsDirs
	if roots == nil {
		roots = RegistryHostsDirs(o.Address)
	}
	hostsDir := hostsDirFor(roots, host)
	creds := &dockerCredentials{dir: o.DockerConfig}
	reg, err := registry.NewOCIRegistry(ctx, ref, registry.WithCredentials(creds), registry.WithHostDir(hostsDir))
	if err != nil {
		return nil, fmt.Errorf("pull %s: %w", ref, err)
	}
	p := platforms.DefaultSpec()
	store := transferimage.NewStore(ref, transferimage.WithPlatforms(p))

	// Our own lease, not the transfer service's: on failure it goes at once
	// with what it holds (a synchronous delete collects the blobs fetched).
	ls := c.cd.LeasesService()
	l, err := ls.Create(ctx, leases.WithRandomID(), leases.WithExpiration(time.Hour))
	if err != nil {
		return nil, fmt.Errorf("pull %s: lease: %w", ref, err)
	}
	lctx := leases.WithLease(ctx, l.ID)
	start := time.Now()
	var topts []transfer.Opt
	var prog *pullProgress
	if o.Progress != nil {
		via := "registry " + host
		if hostsDir != "" {
			via += " (hosts " + hostsDir + ")"
		}
		prog = newPullProgress(o.Progress, o.Terminal, ref, via)
		topts = append(topts, transfer.WithProgress(prog.update))
	}
	err = c.cd.Transfer(lctx, reg, store, topts...)
	if prog != nil {
		prog.finish(err, time.Since(start))
	}
	if err != nil {
		_ = ls.Delete(context.WithoutCancel(ctx), l, leases.SynchronousDelete)
		return nil, classifyPullError(ref, host, hostsDir, creds, err)
	}
	// The image holds its content now.
	_ = ls.Delete(context.WithoutCancel(ctx), l)
	img, err := c.cd.GetImage(ctx, ref)
	if err != nil {
		return nil, fmt.Errorf("pulled %s but containerd does not list it: %w", ref, err)
	}
	return containerd.NewImageWithPlatform(c.cd, img.Metadata(), platforms.Only(p)), nil
}

// PullError tells what part of a pull failed.
type PullError struct {
	Ref  string
	Host string // registry host of the reference (docker.io, ...)
	// Kind is "name resolution", "network", "authentication", "not found" or
	// "pull" (anything else).
	Kind string
	Hint string
	Err  error
}

func (e *PullError) Error() string {
	msg := fmt.Sprintf("pull %s: %s: %v", e.Ref, e.Kind, e.Err)
	if e.Hint != "" {
		msg += " (" + e.Hint + ")"
	}
	return msg
}

// Unwrap gives the errdefs class of Kind and the cause.
func (e *PullError) Unwrap() []error {
	var class error
	switch e.Kind {
	case "not found":
		class = errdefs.ErrNotFound
	case "authentication":
		class = errdefs.ErrUnauthenticated
	case "name resolution", "network":
		class = errdefs.ErrUnavailable
	}
	if class == nil || errors.Is(e.Err, class) {
		return []error{e.Err}
	}
	return []error{class, e.Err}
}

// classifyPullError names what failed. The transfer service runs in
// containerd, so the network's errors arrive as text.
func classifyPullError(ref, host, hostsDir string, creds *dockerCredentials, err error) error {
	if errors.Is(err, context.Canceled) || errors.Is(err, context.DeadlineExceeded) {
		return fmt.Errorf("pull %s: %w", ref, err)
	}
	msg := err.Error()
	has := func(subs ...string) bool {
		for _, s := range subs {
			if strings.Contains(msg, s) {
				return true
			}
		}
		return false
	}
	e := &PullError{Ref: ref, Host: host, Kind: "pull", Err: err}
	cfg := "the mirrors in " + hostsDir
	if hostsDir == "" {
		cfg = "a mirror (no hosts.toml configures " + host + ")"
	}
	switch {
	case has("no such host", "server misbehaving", "Temporary failure in name resolution", "dial tcp: lookup"):
		e.Kind = "name resolution"
		e.Hint = "a registry host's name does not resolve: check DNS, or " + cfg
	case has("connection refused", "i/o timeout", "no route to host", "network is unreachable",
		"connection reset", "TLS handshake", "tls:", "x509:", "EOF", "dial tcp", "Client.Timeout"):
		e.Kind = "network"
		e.Hint = "the registry cannot be reached: check the network, a proxy, or " + cfg
	case has("401 Unauthorized", "403 Forbidden", "authorization failed", "pull access denied",
		"unauthorized", "insufficient_scope", "denied"), errdefs.IsUnauthorized(err), errdefs.IsPermissionDenied(err):
		e.Kind = "authentication"
		e.Hint = creds.hint(host)
	case errdefs.IsNotFound(err), has("not found", "404"):
		e.Kind = "not found"
		e.Hint = "no such image or tag at " + host + ": check the name and tag"
		if has("could not fetch content descriptor", "failed to copy") {
			e.Hint = "the registry lists the image but lacks one of its blobs: ask its owner to push it again"
		}
	}
	return e
}
