package main

import (
	"encoding/json"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"runtime"
	"time"

	"github.com/lazyfork/lazyfork/internal/atomicfile"
)

// vmContext is what `lazyfork vm start` records for the other commands:
// the VM's sockets, forwarded to this host by Lima. While containerd
// answers there (the VM runs) they are the commands' default containerd
// socket and node API; --address, --api and their environment variables
// win over it.
type vmContext struct {
	Instance string `json:"instance"`
	// Dir is the instance's directory on this host (Lima's {{.Dir}}).
	Dir string `json:"dir"`
	// Address is containerd's socket; API is LazyFork's node API.
	Address string `json:"address"`
	API     string `json:"api"`
}

// vmContextPath is where vm start writes the context: $LAZYFORK_VM_CONTEXT,
// else lazyfork/vm.json under the user's config directory
// ($XDG_CONFIG_HOME or ~/.config on Linux, ~/Library/Application Support
// on macOS).
func vmContextPath() (string, error) {
	if p := os.Getenv("LAZYFORK_VM_CONTEXT"); p != "" {
		return p, nil
	}
	dir, err := os.UserConfigDir()
	if err != nil {
		return "", err
	}
	return filepath.Join(dir, "lazyfork", "vm.json"), nil
}

func readVMContext() (*vmContext, error) {
	p, err := vmContextPath()
	if err != nil {
		return nil, err
	}
	b, err := os.ReadFile(p)
	if err != nil {
		return nil, err
	}
	var c vmContext
	if err := json.Unmarshal(b, &c); err != nil {
		return nil, fmt.Errorf("VM context %s: %w (lazyfork vm start rewrites it)", p, err)
	}
	return &c, nil
}

func writeVMContext(c *vmContext) (string, error) {
	p, err := vmContextPath()
	if err != nil {
		return "", err
	}
	if err := os.MkdirAll(filepath.Dir(p), 0o700); err != nil {
		return "", err
	}
	b, err := json.MarshalIndent(c, "", "  ")
	if err != nil {
		return "", err
	}
	return p, atomicfile.WriteFile(p, append(b, '\n'), 0o600)
}

func removeVMContext() error {
	p, err := vmContextPath()
	if err != nil {
		return err
	}
	if err := os.Remove(p); err != nil && !os.IsNotExist(err) {
		return err
	}
	return nil
}

// answers reports whether a unix socket accepts a connection.
func answers(sock string) bool {
	c, err := net.DialTimeout("unix", sock, time.Second)
	if err != nil {
		return false
	}
	c.Close()
	return true
}

// vmDefaults points g at the VM's forwarded sockets when vm start recorded
// them and the VM answers, unless the environment names containerd's
// socket or the node API.
func vmDefaults(g *globals) {
	if os.Getenv("CONTAINERD_ADDRESS") != "" || os.Getenv("LAZYFORK_API") != "" {
		return
	}
	c, err := readVMContext()
	if err != nil || c.Address == "" || c.API == "" || !answers(c.Address) {
		return
	}
	g.address, g.api = c.Address, c.API
}

// stackHint says how to get a stack on this host.
func stackHint() string {
	if runtime.GOOS == "linux" {
		return "start it, or run lazyfork setup (or lazyfork vm start for a VM)"
	}
	return "LazyFork runs in a Linux VM here: run lazyfork vm start"
}
