package harness

import (
	"fmt"
	"sort"
	"strings"
)

// Runtime is an extra CRI runtime handler,
// `[plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.NAME]`. It only matters
// with Options.EnableCRI: clients of the containerd API name runtimes directly
// (`io.containerd.lazyfork.v1`), and containerd finds the shim on its PATH.
type Runtime struct {
	Name        string // handler name, e.g. "lazyfork"
	Type        string // runtime type, e.g. "io.containerd.lazyfork.v1"
	Path        string // optional runtime_path (shim binary)
	Snapshotter string // optional per-handler snapshotter
	// Options is written as the handler's [options] table; string values are quoted,
	// others written with %v. Root for runc-like runtimes defaults to the harness's
	// private runc root.
	Options map[string]any
	// NoOptions writes no [options] table (Options is ignored): CRI then
	// passes no runtime options at all, and the harness gives the LazyFork
	// shim its private runc root through LAZYFORK_RUNC_ROOT instead.
	NoOptions bool
	// PodAnnotations and ContainerAnnotations are passed through to the shim.
	PodAnnotations       []string
	ContainerAnnotations []string
}

// ProxyPlugin is a `[proxy_plugins.NAME]` entry, e.g. LazyFork's snapshotter.
type ProxyPlugin struct {
	Name    string // plugin name, e.g. "lazyfork"
	Type    string // "snapshot" (default) or "content", ...
	Address string // unix socket of the plugin
	// ExportsRoot, when set, is exported as the plugin's root
	// (`[proxy_plugins.NAME.exports] root = ...`).
	ExportsRoot string
}

// config renders containerd's config.toml for this harness.
func (c *Containerd) config() string {
	o := c.opts
	var b strings.Builder
	w := func(format string, args ...any) { fmt.Fprintf(&b, format+"\n", args...) }

	w("version = 3")
	w("root = %q", c.Root)
	w("state = %q", c.State)
	w("imports = []")
	disabled := []string{"io.containerd.nri.v1.nri"}
	if !o.EnableCRI {
		disabled = append(disabled,
			"io.containerd.grpc.v1.cri",
			"io.containerd.cri.v1.runtime",
			"io.containerd.cri.v1.images",
			"io.containerd.podsandbox.controller.v1.podsandbox",
		)
	}
	w("disabled_plugins = [%s]", quoteList(disabled))
	w("")
	w("[grpc]")
	w("  address = %q", c.Address)
	w("[ttrpc]")
	w("  address = %q", c.Address+".ttrpc")
	w("[debug]")
	w("  address = %q", c.Address+".debug")
	level := "info"
	if o.Debug {
		level = "debug"
	}
	w("  level = %q", level)
	w("")
	w("[plugins]")
	w("  [plugins.'io.containerd.shim.v1.manager']")
	w("    socket_dir = %q", c.ShimSocketDir)
	w("  [plugins.'io.containerd.internal.v1.opt']")
	w("    path = %q", c.Dir+"/opt")
	w("  [plugins.'io.containerd.nri.v1.nri']")
	w("    disable = true")
	if o.HostsDir != "" {
		w("  [plugins.'io.containerd.transfer.v1.local']")
		w("    config_path = %q", o.HostsDir)
		if o.EnableCRI {
			w("  [plugins.'io.containerd.cri.v1.images'.registry]")
			w("    config_path = %q", o.HostsDir)
		}
	}
	if o.EnableCRI {
		w("  [plugins.'io.containerd.cri.v1.runtime']")
		w("    restrict_oom_score_adj = true")
		w("    netns_mounts_under_state_dir = true")
		w("    [plugins.'io.containerd.cri.v1.runtime'.cni]")
		w("      conf_dir = %q", c.Dir+"/cni/net.d")
		w("      bin_dirs = [%s]", quoteList([]string{c.Dir + "/cni/bin", "/opt/cni/bin"}))
		w("    [plugins.'io.containerd.cri.v1.runtime'.containerd]")
		w("      default_runtime_name = \"runc\"")
		rts := append([]Runtime{{Name: "runc", Type: "io.containerd.runc.v2"}}, o.Runtimes...)
		for _, r := range rts {
			p := "plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes." + tomlKey(r.Name)
			w("      [%s]", p)
			w("        runtime_type = %q", r.Type)
			if r.Path != "" {
				w("        runtime_path = %q", r.Path)
			}
			if r.Snapshotter != "" {
				w("        snapshotter = %q", r.Snapshotter)
			}
			if len(r.PodAnnotations) > 0 {
				w("        pod_annotations = [%s]", quoteList(r.PodAnnotations))
			}
			if len(r.ContainerAnnotations) > 0 {
				w("        container_annotations = [%s]", quoteList(r.ContainerAnnotations))
			}
			if r.NoOptions {
				continue
			}
			opts := map[string]any{}
			for k, v := range r.Options {
				opts[k] = v
			}
			if _, ok := opts["Root"]; !ok {
				opts["Root"] = c.RuncRoot
			}
			w("        [%s.options]", p)
			keys := make([]string, 0, len(opts))
			for k := range opts {
				keys = append(keys, k)
			}
			sort.Strings(keys)
			for _, k := range keys {
				switch v := opts[k].(type) {
				case string:
					w("          %s = %q", tomlKey(k), v)
				default:
					w("          %s = %v", tomlKey(k), v)
				}
			}
		}
	} else if len(o.Runtimes) > 0 {
		w("# Options.Runtimes ignored: CRI is disabled (clients name runtimes directly)")
	}
	for _, p := range o.ProxyPlugins {
		typ := p.Type
		if typ == "" {
			typ = "snapshot"
		}
		w("")
		w("[proxy_plugins.%s]", tomlKey(p.Name))
		w("  type = %q", typ)
		w("  address = %q", p.Address)
		if p.ExportsRoot != "" {
			w("  [proxy_plugins.%s.exports]", tomlKey(p.Name))
			w("    root = %q", p.ExportsRoot)
		}
	}
	if o.ExtraTOML != "" {
		w("")
		w("%s", o.ExtraTOML)
	}
	return b.String()
}

func quoteList(items []string) string {
	q := make([]string, len(items))
	for i, s := range items {
		q[i] = fmt.Sprintf("%q", s)
	}
	return strings.Join(q, ", ")
}

// tomlKey quotes a key unless it is a bare TOML key.
func tomlKey(k string) string {
	for _, r := range k {
		if !(r >= 'a' && r <= 'z' || r >= 'A' && r <= 'Z' || r >= '0' && r <= '9' || r == '_' || r == '-') {
			return fmt.Sprintf("%q", k)
		}
	}
	return k
}
