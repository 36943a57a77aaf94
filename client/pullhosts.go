package client

import (
	"os"
	"path/filepath"
	"strconv"
	"strings"

	"github.com/pelletier/go-toml/v2"
)

// DefaultHostsDirs are where nerdctl and docker look for per-registry
// configuration (hosts.toml, certificates) when containerd names none.
var DefaultHostsDirs = []string{"/etc/containerd/certs.d", "/etc/docker/certs.d"}

// DefaultContainerdConfig is containerd's config file when it runs without --config.
const DefaultContainerdConfig = "/etc/containerd/config.toml"

// RegistryHostsDirs returns the hosts directories of the containerd serving
// address: the config_path its config gives the transfer service
// ([plugins.'io.containerd.transfer.v1.local'] config_path) or CRI's image
// service (registry.config_path), else DefaultHostsDirs. The daemon is
// found among this host's processes by the gRPC address its config names.
func RegistryHostsDirs(address string) []string {
	if dirs := configPathOf(address); len(dirs) > 0 {
		return dirs
	}
	return DefaultHostsDirs
}

func configPathOf(address string) []string {
	address = filepath.Clean(strings.TrimPrefix(address, "unix://"))
	if address == "." {
		address = "/run/containerd/containerd.sock"
	}
	ents, err := os.ReadDir("/proc")
	if err != nil {
		return nil
	}
	for _, e := range ents {
		pid, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		dir := "/proc/" + strconv.Itoa(pid)
		exe, err := os.Readlink(dir + "/exe")
		if err != nil || filepath.Base(exe) != "containerd" {
			continue
		}
		raw, err := os.ReadFile(dir + "/cmdline")
		if err != nil {
			continue
		}
		cfgPath := configArg(strings.Split(strings.TrimRight(string(raw), "\x00"), "\x00")[1:])
		if !filepath.IsAbs(cfgPath) {
			cwd, err := os.Readlink(dir + "/cwd")
			if err != nil {
				continue
			}
			cfgPath = filepath.Join(cwd, cfgPath)
		}
		addr, paths, ok := readContainerdConfig(cfgPath)
		if !ok || filepath.Clean(addr) != address {
			continue
		}
		return paths
	}
	return nil
}

// configArg is the value of containerd's --config (-c) flag.
func configArg(args []string) string {
	for i, a := range args {
		for _, f := range []string{"--config", "-config", "-c", "--c"} {
			if a == f && i+1 < len(args) {
				return args[i+1]
			}
			if v, ok := strings.CutPrefix(a, f+"="); ok {
				return v
			}
		}
	}
	return DefaultContainerdConfig
}

// readContainerdConfig returns the gRPC address a containerd config names
// and its registry config_path (split on ':').
func readContainerdConfig(path string) (address string, hostsDirs []string, ok bool) {
	b, err := os.ReadFile(path)
	if err != nil {
		return "", nil, false
	}
	var cfg map[string]any
	if err := toml.Unmarshal(b, &cfg); err != nil {
		return "", nil, false
	}
	get := func(m any, keys ...string) any {
		for _, k := range keys {
			mm, ok := m.(map[string]any)
			if !ok {
				return nil
			}
			m = mm[k]
		}
		return m
	}
	address = "/run/containerd/containerd.sock"
	if a, _ := get(cfg, "grpc", "address").(string); a != "" {
		address = a
	}
	for _, keys := range [][]string{
		{"plugins", "io.containerd.transfer.v1.local", "config_path"},
		{"plugins", "io.containerd.cri.v1.images", "registry", "config_path"},
		{"plugins", "io.containerd.grpc.v1.cri", "registry", "config_path"}, // config version 2
	} {
		if p, _ := get(cfg, keys...).(string); p != "" {
			return address, filepath.SplitList(p), true
		}
	}
	return address, nil, true
}

// hostsDirFor picks the one root (the transfer service takes one) holding
// configuration for host: the first with a directory host_port_, host or
// _default, as CRI looks them up; "" when none does (plain defaults: https).
func hostsDirFor(roots []string, host string) string {
	names := []string{host}
	if i := strings.LastIndex(host, ":"); i > 0 {
		names = append([]string{host[:i] + "_" + host[i+1:] + "_"}, names...)
	}
	names = append(names, "_default")
	for _, root := range roots {
		if root == "" {
			continue
		}
		for _, name := range names {
			if fi, err := os.Stat(filepath.Join(root, name)); err == nil && fi.IsDir() {
				return root
			}
		}
	}
	return ""
}
