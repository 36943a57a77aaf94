package client

import (
	"bytes"
	"context"
	"encoding/base64"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strings"
	"sync"
	"time"

	"github.com/containerd/containerd/v2/core/transfer/registry"
	"github.com/containerd/log"
)

// dockerHubServer is the key docker, nerdctl and credential helpers use for
// Docker Hub.
const dockerHubServer = "https://index.docker.io/v1/"

// dockerCredentials reads registry credentials as docker and nerdctl do:
// $DOCKER_CONFIG/config.json (default ~/.docker/config.json): "auths"
// entries (auth, username/password, identitytoken), then "credHelpers" for
// the host and "credsStore" (docker-credential-NAME get).
type dockerCredentials struct {
	dir string // "" means $DOCKER_CONFIG, else ~/.docker

	mu    sync.Mutex
	asked map[string]bool // hosts containerd asked for, and whether we had some
}

// hint says what to do about an authentication failure, naming the hosts
// that asked for credentials (a mirror's own, with hosts.toml).
func (d *dockerCredentials) hint(refHost string) string {
	d.mu.Lock()
	defer d.mu.Unlock()
	var had, lacked []string
	for h, ok := range d.asked {
		if ok {
			had = append(had, h)
		} else {
			lacked = append(lacked, h)
		}
	}
	sort.Strings(had)
	sort.Strings(lacked)
	switch {
	case len(lacked) > 0:
		return fmt.Sprintf("the registry refused anonymous access and %s has no credentials for %s: log in (nerdctl login %s), or check that the repository exists",
			d.file(), strings.Join(lacked, ", "), lacked[0])
	case len(had) > 0:
		return fmt.Sprintf("the registry refused the credentials %s holds for %s: log in again, or check that the repository exists and they may pull it",
			d.file(), strings.Join(had, ", "))
	}
	return fmt.Sprintf("the registry refused access: log in (nerdctl login %s) so %s holds credentials, or check that the repository exists", refHost, d.file())
}

func (d *dockerCredentials) note(host string, found bool) {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.asked == nil {
		d.asked = map[string]bool{}
	}
	d.asked[host] = d.asked[host] || found
}

type dockerAuth struct {
	Auth          string `json:"auth"`
	Username      string `json:"username"`
	Password      string `json:"password"`
	IdentityToken string `json:"identitytoken"`
}

type dockerConfig struct {
	Auths       map[string]dockerAuth `json:"auths"`
	CredsStore  string                `json:"credsStore"`
	CredHelpers map[string]string     `json:"credHelpers"`
}

func (d *dockerCredentials) file() string {
	dir := d.dir
	if dir == "" {
		dir = os.Getenv("DOCKER_CONFIG")
	}
	if dir == "" {
		home, err := os.UserHomeDir()
		if err != nil {
			home = "/root"
		}
		dir = filepath.Join(home, ".docker")
	}
	return filepath.Join(dir, "config.json")
}

// hubHost maps Docker Hub's names to the one its credentials are kept under.
func hubHost(host string) string {
	switch host {
	case "docker.io", "index.docker.io", "registry-1.docker.io", "registry.hub.docker.com":
		return "index.docker.io"
	}
	return host
}

// keyHost is an "auths" key as a host name: scheme and path dropped.
func keyHost(key string) string {
	key = strings.TrimPrefix(strings.TrimPrefix(key, "https://"), "http://")
	if i := strings.Index(key, "/"); i >= 0 {
		key = key[:i]
	}
	return hubHost(key)
}

// GetCredentials answers containerd's request for host's credentials. It
// never fails: without credentials the pull goes on anonymously (an error
// here would leave containerd's request unanswered).
func (d *dockerCredentials) GetCredentials(ctx context.Context, ref, host string) (registry.Credentials, error) {
	c := d.lookup(ctx, host)
	d.note(host, c.Username != "" || c.Secret != "")
	return c, nil
}

func (d *dockerCredentials) lookup(ctx context.Context, host string) registry.Credentials {
	c := registry.Credentials{Host: host}
	b, err := os.ReadFile(d.file())
	if err != nil {
		return c
	}
	var cfg dockerConfig
	if err := json.Unmarshal(b, &cfg); err != nil {
		log.G(ctx).WithError(err).Warnf("lazyfork: %s: not valid JSON; pulling without credentials", d.file())
		return c
	}
	want := hubHost(host)
	server := host
	if want == "index.docker.io" {
		server = dockerHubServer
	}
	if helper := cfg.CredHelpers[host]; helper != "" {
		return d.helper(ctx, helper, server, c)
	}
	for key, a := range cfg.Auths {
		if keyHost(key) != want {
			continue
		}
		user, pass := a.Username, a.Password
		if a.Auth != "" {
			if raw, err := base64.StdEncoding.DecodeString(a.Auth); err == nil {
				if u, p, ok := strings.Cut(string(raw), ":"); ok {
					user, pass = u, p
				}
			}
		}
		if a.IdentityToken != "" {
			c.Secret = a.IdentityToken // a refresh token: no user name
			return c
		}
		if user != "" || pass != "" {
			c.Username, c.Secret = user, pass
			return c
		}
	}
	if cfg.CredsStore != "" {
		return d.helper(ctx, cfg.CredsStore, server, c)
	}
	return c
}

// helper runs docker-credential-NAME get for server.
func (d *dockerCredentials) helper(ctx context.Context, name, server string, c registry.Credentials) registry.Credentials {
	ctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	cmd := exec.CommandContext(ctx, "docker-credential-"+name, "get")
	cmd.Stdin = strings.NewReader(server)
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		log.G(ctx).WithError(err).Warnf("lazyfork: docker-credential-%s get %s: %s", name, server, strings.TrimSpace(stderr.String()))
		return c
	}
	var r struct{ Username, Secret string }
	if err := json.Unmarshal(out, &r); err != nil {
		return c
	}
	if r.Username == "<token>" {
		c.Secret = r.Secret
		return c
	}
	c.Username, c.Secret = r.Username, r.Secret
	return c
}
