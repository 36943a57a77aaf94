package main

import (
	"errors"
	"flag"
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
