//go:build linux

package main

import (
	"bytes"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/pelletier/go-toml/v2"
)

// setupEnv is a node whose containerd config lives in a temporary /etc.
type setupEnv struct {
	t      *testing.T
	a      *app
	o      setupOpts
	out    *bytes.Buffer
	config string
}

func newSetupEnv(t *testing.T) *setupEnv {
	dir := t.TempDir()
	out := &bytes.Buffer{}
	g := defaultGlobals()
	g.root = "/run/lazyfork"
	return &setupEnv{t: t, a: &app{g: g, out: out}, out: out, config: filepath.Join(dir, "etc", "containerd", "config.toml"),
		o: setupOpts{config: filepath.Join(dir, "etc", "containerd", "config.toml"), state: "/var/lib/lazyfork"}}
}

// run plans and applies the node's configuration (version 4, as containerd 2.4
// writes) and reports whether anything changed.
func (e *setupEnv) run(private bool) bool {
	e.t.Helper()
	p, err := e.a.planConfig(e.o, private, 4)
	if err != nil {
		e.t.Fatalf("plan: %v", err)
	}
	changed, err := p.apply(e.a)
	if err != nil {
		e.t.Fatalf("apply: %v", err)
	}
	if bin, err := exec.LookPath("containerd"); err == nil {
		// The check setup runs: containerd itself loads config.toml and its
		// imports and has LazyFork's entries.
		if err := p.verify(bin); err != nil {
			e.t.Fatalf("containerd does not take the result: %v\n%s\n--- drop-in:\n%s", err, e.read(e.config), e.read(dropInPath(e.config)))
		}
	}
	return changed
}

func (e *setupEnv) read(p string) string {
	b, _ := os.ReadFile(p)
	return string(b)
}

func (e *setupEnv) write(p, s string) {
	e.t.Helper()
	if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
		e.t.Fatal(err)
	}
	if err := os.WriteFile(p, []byte(s), 0o644); err != nil {
		e.t.Fatal(err)
	}
}

// tomlOf parses a file the test reads back.
func (e *setupEnv) tomlOf(p string) map[string]any {
	e.t.Helper()
	m := map[string]any{}
	if err := toml.Unmarshal([]byte(e.read(p)), &m); err != nil {
		e.t.Fatalf("%s: %v\n%s", p, err, e.read(p))
	}
	return m
}

// A node without a config: setup creates config.toml (version and import only)
// and the drop-in with the snapshotter and a complete CRI handler; a second
// run changes nothing.
func TestSetupConfigFreshNode(t *testing.T) {
	e := newSetupEnv(t)
	if !e.run(false) {
		t.Fatal("first setup changed nothing")
	}
	main := e.tomlOf(e.config)
	if got := stringList(main["imports"]); len(got) != 1 || got[0] != filepath.Join(filepath.Dir(e.config), "conf.d", "*.toml") {
		t.Errorf("config.toml imports %v", got)
	}
	d := e.tomlOf(dropInPath(e.config))
	if v, _ := lookup(d, "proxy_plugins", "lazyfork", "address"); v != "/run/lazyfork/snapshotter.sock" {
		t.Errorf("drop-in proxy plugin address %v", v)
	}
	rt, ok := lookup(d, "plugins", criRuntimeV3, "containerd", "runtimes", "lazyfork")
	if !ok {
		t.Fatalf("drop-in has no CRI handler:\n%s", e.read(dropInPath(e.config)))
	}
	r := rt.(map[string]any)
	if r["runtime_type"] != "io.containerd.lazyfork.v1" {
		t.Errorf("runtime_type %v", r["runtime_type"])
	}
	for _, k := range []string{"pod_annotations", "container_annotations"} {
		if got := stringList(r[k]); len(got) != 1 || got[0] != "lazyfork.io/*" {
			t.Errorf("handler %s = %v, want ['lazyfork.io/*']", k, got)
		}
	}
	before := e.read(e.config) + e.read(dropInPath(e.config))
	if e.run(false) {
		t.Errorf("second setup changed something:\n%s", e.out)
	}
	if after := e.read(e.config) + e.read(dropInPath(e.config)); after != before {
		t.Errorf("second setup rewrote the files")
	}
}

// The config docs/kubernetes.md told users to write (the handler in
// config.toml, no imports): setup adds the import on top, keeps every line of
// the file, and does not repeat the handler (containerd refused to start on
// "table lazyfork already exists").
func TestSetupConfigExistingHandler(t *testing.T) {
	e := newSetupEnv(t)
	orig := `version = 3
# my settings
root = '/var/lib/containerd'

[plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.lazyfork]
  runtime_type = 'io.containerd.lazyfork.v1'
  pod_annotations = ['lazyfork.io/*']
  container_annotations = ['lazyfork.io/*']
`
	e.write(e.config, orig)
	if !e.run(false) {
		t.Fatal("setup changed nothing")
	}
	got := e.read(e.config)
	if !strings.HasSuffix(got, orig) {
		t.Errorf("config.toml lost its own text:\n%s", got)
	}
	if n := strings.Count(got+e.read(dropInPath(e.config)), "runtimes.lazyfork]"); n != 1 {
		t.Errorf("the handler is defined %d times:\n%s\n--- drop-in:\n%s", n, got, e.read(dropInPath(e.config)))
	}
	if !strings.Contains(e.out.String(), "already defines the CRI runtime handler lazyfork") {
		t.Errorf("setup did not say the handler is there:\n%s", e.out)
	}
	if e.run(false) {
		t.Errorf("second setup changed something:\n%s", e.out)
	}
	if n := strings.Count(e.read(e.config), "imports"); n != 1 {
		t.Errorf("imports written %d times:\n%s", n, e.read(e.config))
	}
}

// A handler defined without LazyFork's annotations is reported: under it a
// fork-of pod would start from scratch.
func TestSetupConfigHandlerWithoutAnnotations(t *testing.T) {
	e := newSetupEnv(t)
	e.write(e.config, `version = 3
imports = ['/etc/containerd/conf.d/*.toml']
[plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.lazyfork]
  runtime_type = 'io.containerd.lazyfork.v1'
`)
	p, err := e.a.planConfig(e.o, false, 4)
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(strings.Join(p.notes, "\n"), "lacks pod_annotations/container_annotations") {
		t.Errorf("no warning about the annotations: %q", p.notes)
	}
	if p.mainAction != "rewritten with the import (original kept as config.toml.lazyfork-orig)" {
		t.Errorf("config.toml whose imports miss conf.d: %q", p.mainAction)
	}
	if bin, err := exec.LookPath("containerd"); err == nil {
		if _, err := p.apply(e.a); err != nil {
			t.Fatal(err)
		}
		if err := p.verify(bin); err == nil || !strings.Contains(err.Error(), "pod annotations") {
			t.Errorf("verify of a handler without annotations: %v", err)
		}
		if e.read(e.config+".lazyfork-orig") == "" {
			t.Errorf("no copy of the original config.toml")
		}
	}
}

// A handler of LazyFork's runtime type with an [options] table is reported:
// containerd cannot start user-namespace pods under it. The handler setup
// writes has none.
func TestSetupConfigHandlerWithOptions(t *testing.T) {
	e := newSetupEnv(t)
	e.write(e.config, `version = 3
imports = ['/etc/containerd/conf.d/*.toml']
[plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.lazyfork]
  runtime_type = 'io.containerd.lazyfork.v1'
  pod_annotations = ['lazyfork.io/*']
  container_annotations = ['lazyfork.io/*']
  [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.lazyfork.options]
    SystemdCgroup = false
`)
	p, err := e.a.planConfig(e.o, false, 4)
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(strings.Join(p.notes, "\n"), "user-namespace pods") {
		t.Errorf("no warning about user-namespace pods: %q", p.notes)
	}

	fresh := newSetupEnv(t)
	fresh.run(false)
	rt, ok := lookup(fresh.tomlOf(dropInPath(fresh.config)), "plugins", criRuntimeV3, "containerd", "runtimes", "lazyfork")
	if !ok {
		t.Fatal("drop-in has no CRI handler")
	}
	if _, has := rt.(map[string]any)["options"]; has {
		t.Errorf("setup's handler has an [options] table:\n%s", fresh.read(dropInPath(fresh.config)))
	}
}

// A config.toml that is not TOML is not touched.
func TestSetupConfigInvalid(t *testing.T) {
	e := newSetupEnv(t)
	e.write(e.config, "version = 3\n[plugins\n")
	if _, err := e.a.planConfig(e.o, false, 4); err == nil || !strings.Contains(err.Error(), "not valid TOML") {
		t.Fatalf("plan of a broken config: %v", err)
	}
}

// A private stack's config: its own root, state, sockets and shim socket
// directory, CRI disabled, no handler.
func TestSetupConfigPrivate(t *testing.T) {
	e := newSetupEnv(t)
	dir := filepath.Dir(e.config)
	e.a.g.address = filepath.Join(dir, "c.sock")
	e.o.state = filepath.Join(dir, "state")
	e.run(true)
	m := e.tomlOf(e.config)
	if m["root"] != filepath.Join(dir, "state", "containerd") {
		t.Errorf("root %v", m["root"])
	}
	if v, _ := lookup(m, "plugins", "io.containerd.server.v1.grpc", "address"); v != e.a.g.address {
		t.Errorf("grpc address %v", v)
	}
	if v, _ := lookup(m, "plugins", "io.containerd.shim.v1.manager", "socket_dir"); v != shimSocketDir(e.o.state) || len(v.(string)) > maxSocketDir {
		t.Errorf("shim socket_dir %v", v)
	}
	if strings.Contains(e.read(dropInPath(e.config)), "runtimes") {
		t.Errorf("private drop-in has a CRI handler:\n%s", e.read(dropInPath(e.config)))
	}
	if e.run(true) {
		t.Errorf("second setup changed something")
	}
}

// --down removes the drop-in and a config.toml setup created; a config.toml
// the user wrote (or changed) stays.
func TestSetupConfigRemove(t *testing.T) {
	e := newSetupEnv(t)
	e.run(false)
	if err := e.a.removeConfig(e.config); err != nil {
		t.Fatal(err)
	}
	for _, p := range []string{e.config, dropInPath(e.config)} {
		if _, err := os.Stat(p); !os.IsNotExist(err) {
			t.Errorf("%s left after --down (%v)", p, err)
		}
	}

	e = newSetupEnv(t)
	e.write(e.config, "version = 3\nroot = '/srv/containerd'\n")
	e.run(false)
	if err := e.a.removeConfig(e.config); err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(e.read(e.config), "root = '/srv/containerd'") {
		t.Errorf("the user's config.toml went:\n%s", e.read(e.config))
	}
	if _, err := os.Stat(dropInPath(e.config)); !os.IsNotExist(err) {
		t.Errorf("drop-in left")
	}
}
