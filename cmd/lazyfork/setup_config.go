//go:build linux

package main

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"reflect"
	"slices"
	"strings"
	"time"

	"github.com/containerd/errdefs"
	"github.com/pelletier/go-toml/v2"

	"github.com/lazyfork/lazyfork/api"
	"github.com/lazyfork/lazyfork/internal/atomicfile"
)

// LazyFork's containerd configuration is a drop-in, conf.d/lazyfork.toml beside
// containerd's config.toml, which config.toml reaches through `imports` (as
// containerd 2.x's default config does: imports = ['/etc/containerd/conf.d/*.toml']).
// Every file is produced and read back by go-toml; nothing is concatenated.

const (
	dropInDir  = "conf.d"
	dropInName = "lazyfork.toml"
	// lazyforkAnnotations lets LazyFork's annotations through CRI to the shim:
	// without them a pod annotated lazyfork.io/fork-of would start from scratch.
	lazyforkAnnotations = api.Prefix + "*"
	// markerComment heads every file setup writes: --down removes only those.
	markerComment = "Written by `lazyfork setup`; `lazyfork setup --down` removes it."
	// criRuntimeV3 / criRuntimeV2 hold CRI's runtime handlers in config
	// versions 3 and 4 / 2.
	criRuntimeV3 = "io.containerd.cri.v1.runtime"
	criRuntimeV2 = "io.containerd.grpc.v1.cri"
)

// criPlugins are disabled in a private config: a private stack serves the
// containerd API only, and never competes with the node's CRI.
var criPlugins = []string{"io.containerd.nri.v1.nri", "io.containerd.grpc.v1.cri", criRuntimeV3, "io.containerd.cri.v1.images", "io.containerd.podsandbox.controller.v1.podsandbox"}

func dropInPath(config string) string {
	return filepath.Join(filepath.Dir(config), dropInDir, dropInName)
}

type proxyPluginTOML struct {
	Type    string            `toml:"type"`
	Address string            `toml:"address"`
	Exports map[string]string `toml:"exports,omitempty"`
}

type runtimeTOML struct {
	RuntimeType          string   `toml:"runtime_type" comment:"No [options] table: with one, containerd's CRI cannot start the containers of\nuser-namespace pods (hostUsers: false) under this runtime type (docs/kubernetes.md)."`
	PodAnnotations       []string `toml:"pod_annotations"`
	ContainerAnnotations []string `toml:"container_annotations"`
}

// dropInTOML is conf.d/lazyfork.toml.
type dropInTOML struct {
	Version      int                        `toml:"version" comment:"LazyFork's containerd configuration, imported by containerd's config.toml.\nWritten by lazyfork setup; lazyfork setup --down removes it."`
	ProxyPlugins map[string]proxyPluginTOML `toml:"proxy_plugins,omitempty"`
	Plugins      map[string]any             `toml:"plugins,omitempty"`
}

// mainTOML is the config.toml setup writes when there is none: for the node's
// containerd only the version and the import; for a private stack its own
// root, state, sockets and shim socket directory, CRI disabled.
type mainTOML struct {
	Version         int            `toml:"version" comment:"Written by lazyfork setup; lazyfork setup --down removes it while it holds nothing else."`
	Root            string         `toml:"root,omitempty"`
	State           string         `toml:"state,omitempty"`
	Imports         []string       `toml:"imports"`
	DisabledPlugins []string       `toml:"disabled_plugins,omitempty"`
	GRPC            *addressTOML   `toml:"grpc,omitempty"`
	TTRPC           *addressTOML   `toml:"ttrpc,omitempty"`
	Debug           *addressTOML   `toml:"debug,omitempty"`
	Plugins         map[string]any `toml:"plugins,omitempty"`
}

type addressTOML struct {
	Address string `toml:"address"`
}

// configPlan is what setup writes: a file's new bytes, or nil for no change.
type configPlan struct {
	version      int
	main, dropIn string
	mainBytes    []byte // nil: config.toml stays as it is
	mainAction   string // what happens to config.toml, for the user
	dropInBytes  []byte // nil: no drop-in needed (everything defined elsewhere)
	notes        []string
	criDisabled  bool
}

// containerdConfigVersion is the config version the containerd that setup
// configures writes (`containerd config default`): a drop-in of an older
// version is migrated, with a warning, at every start; a newer one is refused.
// Without a containerd binary: 3, which every containerd 2.x reads.
func containerdConfigVersion(bin string) int {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	out, err := exec.CommandContext(ctx, bin, "config", "default").Output()
	if err != nil {
		return 3
	}
	var v struct {
		Version int `toml:"version"`
	}
	if err := toml.Unmarshal(out, &v); err != nil || v.Version < 2 {
		return 3
	}
	return v.Version
}

// loadTOML reads a TOML file into a map; a missing file is (nil, nil).
func loadTOML(path string) (map[string]any, []byte, error) {
	b, err := os.ReadFile(path)
	if errors.Is(err, os.ErrNotExist) {
		return nil, nil, nil
	}
	if err != nil {
		return nil, nil, err
	}
	m := map[string]any{}
	if err := toml.Unmarshal(b, &m); err != nil {
		return nil, b, fmt.Errorf("containerd config %s is not valid TOML (fix it, then run setup again): %w: %w", path, err, errdefs.ErrInvalidArgument)
	}
	return m, b, nil
}

// lookup walks nested tables.
func lookup(m map[string]any, keys ...string) (any, bool) {
	var cur any = m
	for _, k := range keys {
		t, ok := cur.(map[string]any)
		if !ok {
			return nil, false
		}
		if cur, ok = t[k]; !ok {
			return nil, false
		}
	}
	return cur, true
}

func stringList(v any) []string {
	l, _ := v.([]any)
	var out []string
	for _, e := range l {
		if s, ok := e.(string); ok {
			out = append(out, s)
		}
	}
	return out
}

// resolveImports lists the files a config's imports name, as containerd does
// (relative to the config's directory, globs expanded).
func resolveImports(parent string, m map[string]any) []string {
	var out []string
	for _, p := range stringList(m["imports"]) {
		p = filepath.Clean(p)
		if !filepath.IsAbs(p) {
			p = filepath.Join(filepath.Dir(parent), p)
		}
		if strings.Contains(p, "*") {
			matches, _ := filepath.Glob(p)
			out = append(out, matches...)
		} else {
			out = append(out, p)
		}
	}
	return out
}

// importsReach reports whether a config's imports name path (directly or by a
// glob), whether or not the file exists yet.
func importsReach(parent string, m map[string]any, path string) bool {
	for _, p := range stringList(m["imports"]) {
		p = filepath.Clean(p)
		if !filepath.IsAbs(p) {
			p = filepath.Join(filepath.Dir(parent), p)
		}
		if ok, _ := filepath.Match(p, path); ok || p == path {
			return true
		}
	}
	return false
}

// elsewhere is what the node's configuration, apart from LazyFork's drop-in,
// already holds.
type elsewhere struct {
	proxy, runtime  string   // the file defining each, "" if none
	runtimeAnnots   []string // pod_annotations of the runtime found
	runtimeCAnnots  []string
	runtimeType     string // its runtime_type
	runtimeOptions  bool   // it has an [options] table
	criDisabled     bool
	version         int // config.toml's version (0: no file)
	mainHasImports  bool
	dropInReachable bool
}

// scanConfig walks config.toml and its imports (skipping the drop-in) the way
// containerd loads them.
func scanConfig(config, dropIn string) (elsewhere, map[string]any, []byte, error) {
	var e elsewhere
	main, raw, err := loadTOML(config)
	if err != nil || main == nil {
		return e, main, raw, err
	}
	e.version = 1
	if v, ok := main["version"].(int64); ok {
		e.version = int(v)
	}
	_, e.mainHasImports = main["imports"]
	e.dropInReachable = importsReach(config, main, dropIn)
	for _, p := range stringList(main["disabled_plugins"]) {
		if p == criRuntimeV2 || p == criRuntimeV3 {
			e.criDisabled = true
		}
	}
	seen := map[string]bool{dropIn: true}
	pending := []string{config}
	for len(pending) > 0 {
		p := pending[0]
		pending = pending[1:]
		if seen[p] {
			continue
		}
		seen[p] = true
		m := main
		if p != config {
			if m, _, err = loadTOML(p); err != nil {
				return e, main, raw, err
			}
			if m == nil {
				continue
			}
		}
		if _, ok := lookup(m, "proxy_plugins", "lazyfork"); ok && e.proxy == "" {
			e.proxy = p
		}
		for _, plugin := range []string{criRuntimeV3, criRuntimeV2} {
			if rt, ok := lookup(m, "plugins", plugin, "containerd", "runtimes", "lazyfork"); ok && e.runtime == "" {
				e.runtime = p
				r, _ := rt.(map[string]any)
				e.runtimeAnnots = stringList(r["pod_annotations"])
				e.runtimeCAnnots = stringList(r["container_annotations"])
				e.runtimeType, _ = r["runtime_type"].(string)
				_, e.runtimeOptions = r["options"]
			}
		}
		pending = append(pending, resolveImports(p, m)...)
	}
	return e, main, raw, nil
}

// planConfig decides what setup writes for config (a private stack's when
// private) and checks what is there.
func (a *app) planConfig(o setupOpts, private bool, version int) (*configPlan, error) {
	p := &configPlan{version: version, main: o.config, dropIn: dropInPath(o.config)}
	e, main, raw, err := scanConfig(o.config, p.dropIn)
	if err != nil {
		return nil, err
	}
	imports := []string{filepath.Join(filepath.Dir(o.config), dropInDir, "*.toml")}
	switch {
	case main == nil:
		m := mainTOML{Version: version, Imports: imports}
		if private {
			m = a.privateMain(o, version, imports)
			p.criDisabled = true
		}
		if p.mainBytes, err = toml.Marshal(m); err != nil {
			return nil, err
		}
		p.mainAction = "created"
	case e.dropInReachable:
		p.criDisabled = e.criDisabled
	case !e.mainHasImports:
		// A top-level key may precede everything: the import goes on top, the
		// rest of the file (and its comments) stays as it is.
		line, err := toml.Marshal(struct {
			Imports []string `toml:"imports" comment:"Added by lazyfork setup: containerd's drop-in directory (as in containerd config default)."`
		}{imports})
		if err != nil {
			return nil, err
		}
		p.mainBytes = append(append(line, '\n'), raw...)
		p.mainAction = "import added"
		p.criDisabled = e.criDisabled
	default:
		// imports exists and misses conf.d: the file is rewritten by go-toml
		// (comments are lost; the original is kept beside it).
		main["imports"] = append(main["imports"].([]any), imports[0])
		if p.mainBytes, err = toml.Marshal(main); err != nil {
			return nil, err
		}
		p.mainAction = "rewritten with the import (original kept as " + filepath.Base(o.config) + ".lazyfork-orig)"
		p.criDisabled = e.criDisabled
	}
	if p.mainBytes != nil {
		if err := checkSameConfig(raw, p.mainBytes, imports[0], main == nil); err != nil {
			return nil, fmt.Errorf("containerd config %s: %w", o.config, err)
		}
	}

	d := dropInTOML{Version: version}
	if e.proxy == "" {
		d.ProxyPlugins = map[string]proxyPluginTOML{"lazyfork": {
			Type:    "snapshot",
			Address: a.snapshotterAddress(o),
			Exports: map[string]string{"root": filepath.Join(o.state, "snapshotter")},
		}}
	} else {
		p.notes = append(p.notes, fmt.Sprintf("config: %s already defines proxy_plugins.lazyfork: not repeated in %s", e.proxy, p.dropIn))
	}
	switch {
	case p.criDisabled:
	case e.runtime == "":
		plugin := criRuntimeV3
		if version < 3 {
			plugin = criRuntimeV2
		}
		d.Plugins = map[string]any{plugin: map[string]any{"containerd": map[string]any{"runtimes": map[string]any{
			"lazyfork": runtimeTOML{
				RuntimeType:          api.RuntimeName,
				PodAnnotations:       []string{lazyforkAnnotations},
				ContainerAnnotations: []string{lazyforkAnnotations},
			}}}}}
	default:
		p.notes = append(p.notes, fmt.Sprintf("config: %s already defines the CRI runtime handler lazyfork: not repeated in %s", e.runtime, p.dropIn))
		if !slices.Contains(e.runtimeAnnots, lazyforkAnnotations) || !slices.Contains(e.runtimeCAnnots, lazyforkAnnotations) {
			p.notes = append(p.notes, fmt.Sprintf("config: WARNING: that handler lacks pod_annotations/container_annotations = ['%s']: pods annotated lazyfork.io/fork-of start from scratch under it; add both", lazyforkAnnotations))
		}
		if e.runtimeType == api.RuntimeName && e.runtimeOptions {
			p.notes = append(p.notes, userNSOptionsWarning)
		}
	}
	if d.ProxyPlugins != nil || d.Plugins != nil {
		if p.dropInBytes, err = toml.Marshal(d); err != nil {
			return nil, err
		}
	}
	return p, nil
}

// userNSOptionsWarning reports a handler of LazyFork's runtime type with an
// [options] table: containerd's CRI sends such options as a generic
// runtimeoptions message, and for a user-namespace pod it sets the task's I/O
// owner by reading them as runc's, which fails ("can't unmarshal type
// runtimeoptions.v1.Options"), before the shim is asked.
const userNSOptionsWarning = "config: WARNING: that handler has an [options] table: containerd cannot start containers of user-namespace pods (hostUsers: false) under it; drop the table (LazyFork's shim takes its settings from its environment), or see docs/kubernetes.md for a handler of runtime_type io.containerd.runc.v2"

// privateMain is a private stack's config.toml: everything under --state and
// next to --address, so it shares nothing with the node's containerd.
func (a *app) privateMain(o setupOpts, version int, imports []string) mainTOML {
	m := mainTOML{
		Version:         version,
		Root:            filepath.Join(o.state, "containerd"),
		State:           filepath.Join(o.state, "containerd-state"),
		Imports:         imports,
		DisabledPlugins: criPlugins,
		Plugins: map[string]any{
			// Shim sockets under the stack's own state (the default,
			// /run/containerd/s, is shared by every containerd).
			"io.containerd.shim.v1.manager": map[string]any{"socket_dir": shimSocketDir(o.state)},
		},
	}
	if version >= 4 {
		m.Plugins["io.containerd.server.v1.grpc"] = map[string]any{"address": a.g.address}
		m.Plugins["io.containerd.server.v1.ttrpc"] = map[string]any{"address": a.g.address + ".ttrpc"}
		m.Plugins["io.containerd.server.v1.debug"] = map[string]any{"address": a.g.address + ".debug"}
	} else {
		m.GRPC = &addressTOML{a.g.address}
		m.TTRPC = &addressTOML{a.g.address + ".ttrpc"}
		m.Debug = &addressTOML{a.g.address + ".debug"}
	}
	return m
}

// maxSocketDir is the longest socket_dir containerd takes (a unix socket path
// has 108 bytes; the shim's socket name takes the rest).
const maxSocketDir = 42

// shimSocketDir is a private stack's shim socket directory: STATE/s, or when
// that is too long for containerd, /run/lazyfork-shims/<hash of STATE>.
func shimSocketDir(state string) string {
	if d := filepath.Join(state, "s"); len(d) <= maxSocketDir {
		return d
	}
	sum := sha256.Sum256([]byte(state))
	return filepath.Join("/run/lazyfork-shims", hex.EncodeToString(sum[:6]))
}

// checkSameConfig parses the new config.toml and checks it says what the old
// one said plus the import, nothing else.
func checkSameConfig(old, updated []byte, imp string, created bool) error {
	n := map[string]any{}
	if err := toml.Unmarshal(updated, &n); err != nil {
		return fmt.Errorf("the updated file does not parse (not written): %w", err)
	}
	if !slices.Contains(stringList(n["imports"]), imp) {
		return fmt.Errorf("the updated file lacks the import %s (not written): %w", imp, errdefs.ErrInternal)
	}
	if created {
		return nil
	}
	o := map[string]any{}
	if err := toml.Unmarshal(old, &o); err != nil {
		return err
	}
	delete(n, "imports")
	delete(o, "imports")
	if !reflect.DeepEqual(o, n) {
		return fmt.Errorf("the updated file differs from the original beyond its imports (not written): %w", errdefs.ErrInternal)
	}
	return nil
}

// print shows what setup would write.
func (p *configPlan) print(a *app) {
	if p.mainBytes != nil {
		fmt.Fprintf(a.out, "# %s (%s)\n%s\n", p.main, p.mainAction, p.mainBytes)
	} else {
		fmt.Fprintf(a.out, "# %s: unchanged (its imports reach %s)\n\n", p.main, p.dropIn)
	}
	if p.dropInBytes != nil {
		fmt.Fprintf(a.out, "# %s\n%s", p.dropIn, p.dropInBytes)
	}
	for _, n := range p.notes {
		fmt.Fprintf(a.out, "# %s\n", n)
	}
}

// apply writes the plan; it reports whether anything changed.
func (p *configPlan) apply(a *app) (bool, error) {
	changed := false
	for _, n := range p.notes {
		fmt.Fprintln(a.out, n)
	}
	if p.dropInBytes != nil {
		old, err := os.ReadFile(p.dropIn)
		if err != nil && !errors.Is(err, os.ErrNotExist) {
			return false, err
		}
		if bytes.Equal(old, p.dropInBytes) {
			fmt.Fprintf(a.out, "config: %s already has LazyFork's entries\n", p.dropIn)
		} else {
			if err := os.MkdirAll(filepath.Dir(p.dropIn), 0o755); err != nil {
				return false, err
			}
			if err := atomicfile.WriteFile(p.dropIn, p.dropInBytes, 0o644); err != nil {
				return false, fmt.Errorf("write %s: %w", p.dropIn, err)
			}
			changed = true
			fmt.Fprintf(a.out, "config: wrote %s\n", p.dropIn)
		}
	}
	if p.mainBytes != nil {
		if err := os.MkdirAll(filepath.Dir(p.main), 0o755); err != nil {
			return changed, err
		}
		if strings.HasPrefix(p.mainAction, "rewritten") {
			old, err := os.ReadFile(p.main)
			if err != nil {
				return changed, err
			}
			if err := atomicfile.WriteFile(p.main+".lazyfork-orig", old, 0o644); err != nil {
				return changed, err
			}
		}
		if err := atomicfile.WriteFile(p.main, p.mainBytes, 0o644); err != nil {
			return changed, fmt.Errorf("write %s: %w", p.main, err)
		}
		changed = true
		fmt.Fprintf(a.out, "config: %s: %s\n", p.main, p.mainAction)
	} else {
		fmt.Fprintf(a.out, "config: %s imports %s\n", p.main, p.dropIn)
	}
	return changed, nil
}

// verify loads the configuration as containerd does (`containerd config
// dump`, which reads config.toml and its imports) and checks LazyFork's
// entries are in effect.
func (p *configPlan) verify(containerdBin string) error {
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	cmd := exec.CommandContext(ctx, containerdBin, "--config", p.main, "config", "dump")
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		return fmt.Errorf("containerd does not load %s (%v): %s: %w", p.main, err, strings.TrimSpace(stderr.String()), errdefs.ErrFailedPrecondition)
	}
	m := map[string]any{}
	if err := toml.Unmarshal(out, &m); err != nil {
		return fmt.Errorf("containerd config dump: %w", err)
	}
	if v, _ := lookup(m, "proxy_plugins", "lazyfork", "address"); v == nil {
		return fmt.Errorf("containerd's loaded config (%s) has no proxy_plugins.lazyfork: is %s imported? %w", p.main, p.dropIn, errdefs.ErrFailedPrecondition)
	}
	if !p.criDisabled {
		rt, ok := lookup(m, "plugins", criRuntimeV3, "containerd", "runtimes", "lazyfork")
		if !ok {
			rt, ok = lookup(m, "plugins", criRuntimeV2, "containerd", "runtimes", "lazyfork")
		}
		if !ok {
			return fmt.Errorf("containerd's loaded config (%s) has no CRI runtime handler lazyfork: %w", p.main, errdefs.ErrFailedPrecondition)
		}
		r, _ := rt.(map[string]any)
		if !slices.Contains(stringList(r["pod_annotations"]), lazyforkAnnotations) {
			return fmt.Errorf("containerd's CRI runtime handler lazyfork lets no %s pod annotations through (pods annotated lazyfork.io/fork-of would start from scratch): add pod_annotations = ['%s']: %w", lazyforkAnnotations, lazyforkAnnotations, errdefs.ErrFailedPrecondition)
		}
	}
	return nil
}

// removeConfig undoes what setup wrote: the drop-in (when it is setup's), and
// config.toml when setup created it and it still holds only what setup wrote.
// An import setup added to an existing config.toml stays: it names
// containerd's own drop-in directory.
func (a *app) removeConfig(config string) error {
	dropIn := dropInPath(config)
	if b, err := os.ReadFile(dropIn); err == nil {
		if !bytes.Contains(firstLine(b), []byte("LazyFork's containerd configuration")) {
			fmt.Fprintf(a.out, "config: %s was not written by setup: left alone\n", dropIn)
		} else if err := os.Remove(dropIn); err != nil {
			return err
		} else {
			fmt.Fprintf(a.out, "config: removed %s\n", dropIn)
			_ = os.Remove(filepath.Dir(dropIn)) // only if empty
		}
	} else if !errors.Is(err, os.ErrNotExist) {
		return err
	}
	b, err := os.ReadFile(config)
	if errors.Is(err, os.ErrNotExist) {
		return nil
	}
	if err != nil {
		return err
	}
	if !bytes.Contains(firstLine(b), []byte("Written by lazyfork setup")) {
		return nil
	}
	var m mainTOML
	if err := toml.NewDecoder(bytes.NewReader(b)).DisallowUnknownFields().Decode(&m); err != nil {
		fmt.Fprintf(a.out, "config: %s was changed since setup wrote it: left alone\n", config)
		return nil
	}
	for k := range m.Plugins {
		if k != "io.containerd.shim.v1.manager" && !strings.HasPrefix(k, "io.containerd.server.v1.") {
			fmt.Fprintf(a.out, "config: %s was changed since setup wrote it (plugins.%s): left alone\n", config, k)
			return nil
		}
	}
	if err := os.Remove(config); err != nil {
		return err
	}
	fmt.Fprintf(a.out, "config: removed %s\n", config)
	return nil
}

func firstLine(b []byte) []byte {
	if i := bytes.IndexByte(b, '\n'); i >= 0 {
		return b[:i]
	}
	return b
}
