package main

import (
	"bytes"
	"errors"
	"flag"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// Every command answers --help with its usage and examples, and no error.
func TestHelp(t *testing.T) {
	for name := range commands {
		if err := run([]string{name, "--help"}); !errors.Is(err, flag.ErrHelp) {
			t.Errorf("%s --help: %v", name, err)
		}
		if commands[name].example == "" {
			t.Errorf("%s has no examples", name)
		}
	}
	if err := run([]string{"help"}); err != nil {
		t.Errorf("help: %v", err)
	}
}

func TestBadInput(t *testing.T) {
	if err := run([]string{"nosuch"}); err == nil || !strings.Contains(err.Error(), `unknown command "nosuch"`) {
		t.Errorf("unknown command: %v", err)
	}
	if err := run(nil); err == nil {
		t.Error("no command: no error")
	}
	// No containerd at this address: a clear error, not a hang.
	sock := filepath.Join(t.TempDir(), "none.sock")
	err := run([]string{"--address", sock, "list"})
	if err == nil || !strings.Contains(err.Error(), "no containerd at "+sock) {
		t.Fatalf("list without containerd: %v", err)
	}
}

// setup --print shows the entries without touching anything.
func TestSetupPrint(t *testing.T) {
	dir := t.TempDir()
	r, w, _ := os.Pipe()
	old := os.Stdout
	os.Stdout = w
	err := run([]string{"--address", dir + "/c.sock", "--root", dir + "/root", "setup", "--print", "--config", dir + "/config.toml", "--state", dir + "/state"})
	w.Close()
	os.Stdout = old
	var out bytes.Buffer
	out.ReadFrom(r)
	if err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{"version = 3", "[proxy_plugins.lazyfork]", dir + "/root/snapshotter.sock", dir + "/state/snapshotter", dir + "/c.sock"} {
		if !strings.Contains(out.String(), want) {
			t.Errorf("setup --print lacks %q:\n%s", want, out.String())
		}
	}
	if _, err := os.Stat(dir + "/config.toml"); !os.IsNotExist(err) {
		t.Errorf("--print wrote a config")
	}
	// The system config variant registers the runtime for CRI too.
	a := &app{g: defaultGlobals()}
	txt := a.configText(setupOpts{state: "/var/lib/lazyfork"}, "", false)
	if !strings.Contains(txt, `runtime_type = "io.containerd.lazyfork.v1"`) || !strings.Contains(txt, "version = 3") {
		t.Errorf("system config:\n%s", txt)
	}
	if txt := a.configText(setupOpts{state: "/x"}, "version = 2\n", false); !strings.Contains(txt, `plugins."io.containerd.grpc.v1.cri".containerd.runtimes.lazyfork`) || strings.Contains(txt, "version = 3") {
		t.Errorf("entries for a version 2 config:\n%s", txt)
	}
}
