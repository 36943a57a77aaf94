package server

import (
	"bytes"
	"errors"
	"fmt"
	"os"
	"time"

	"github.com/containerd/errdefs"
	"github.com/pelletier/go-toml/v2"

	"github.com/lazyfork/lazyfork/api"
	"github.com/lazyfork/lazyfork/snapshotter/client"
)

// Config is lazyfork-snapshotter's configuration (the --config TOML file).
type Config struct {
	// Root holds metadata.db and the layers.
	Root string `toml:"root"`
	// Address is the unix socket of containerd's snapshots gRPC API.
	Address string `toml:"address"`
	// TTRPCAddress is the unix socket of the lazyfork.v1 API
	// (default: Address + ".ttrpc").
	TTRPCAddress string `toml:"ttrpc_address"`
	// LazyForkRoot is LazyFork's root (the shim's LAZYFORK_ROOT), whose
	// files the lazyfork.v1 Node API serves to clients.
	LazyForkRoot string `toml:"lazyfork_root"`
	// MountOptions are added to every overlay mount.
	MountOptions []string `toml:"mount_options"`
	// AsyncRemove leaves freeing removed layers' disk to Cleanup (containerd's
	// GC calls it after removing), which keeps Remove fast.
	AsyncRemove bool `toml:"async_remove"`
	// LogLevel: trace, debug, info, warn, error.
	LogLevel string `toml:"log_level"`
	// MemoryGCInterval is how often the memory store of LazyForkRoot is
	// collected (what lazyfork gc ends with): memory files no live holder
	// references and no process maps are freed, with the references and
	// views of tasks whose bundle containerd removed without a delete (a
	// shim killed while it created the task). 0 turns it off.
	MemoryGCInterval Duration `toml:"memory_gc_interval"`
}

// DefaultMemoryGCInterval: a leaked memory file can be a whole heap, and a
// collection reads each family's references (and, while some file is
// referenced by nobody, every process's mappings): little, once a minute.
const DefaultMemoryGCInterval = time.Minute

// Duration is a time.Duration written as in Go ("90s", "5m"; "0" for none).
type Duration time.Duration

// UnmarshalText parses a Go duration; negative ones are refused.
func (d *Duration) UnmarshalText(b []byte) error {
	v, err := time.ParseDuration(string(b))
	if err != nil {
		return fmt.Errorf("duration %q (write it as 90s, 5m or 0): %w", b, errdefs.ErrInvalidArgument)
	}
	if v < 0 {
		return fmt.Errorf("duration %q is negative: %w", b, errdefs.ErrInvalidArgument)
	}
	*d = Duration(v)
	return nil
}

// MarshalText writes it as Go does.
func (d Duration) MarshalText() ([]byte, error) { return []byte(time.Duration(d).String()), nil }

// DefaultRoot is where the layers live unless configured otherwise.
const DefaultRoot = "/var/lib/lazyfork/snapshotter"

// DefaultConfig is the configuration without a file or flags.
func DefaultConfig() Config {
	root := api.DefaultRoot
	if v := os.Getenv("LAZYFORK_ROOT"); v != "" {
		root = v
	}
	return Config{Root: DefaultRoot, Address: client.DefaultAddress, LazyForkRoot: root, LogLevel: "info",
		MemoryGCInterval: Duration(DefaultMemoryGCInterval)}
}

// LoadConfig reads a TOML file over DefaultConfig; unknown keys are errors,
// so a typo does not silently fall back to a default.
func LoadConfig(path string) (Config, error) {
	cfg := DefaultConfig()
	b, err := os.ReadFile(path)
	if err != nil {
		return cfg, err
	}
	d := toml.NewDecoder(bytes.NewReader(b))
	d.DisallowUnknownFields()
	if err := d.Decode(&cfg); err != nil {
		var strict *toml.StrictMissingError
		if errors.As(err, &strict) {
			return cfg, fmt.Errorf("config %s: unknown keys:\n%s: %w", path, strict.String(), errdefs.ErrInvalidArgument)
		}
		return cfg, fmt.Errorf("config %s: %v: %w", path, err, errdefs.ErrInvalidArgument)
	}
	return cfg, nil
}

// ttrpcAddress is where the ttrpc API listens.
func (c Config) ttrpcAddress() string {
	if c.TTRPCAddress != "" {
		return c.TTRPCAddress
	}
	return client.TTRPCAddress(c.Address)
}

// Validate reports the first unusable setting.
func (c Config) Validate() error {
	switch {
	case c.Root == "":
		return fmt.Errorf("root is empty: %w", errdefs.ErrInvalidArgument)
	case c.LazyForkRoot == "":
		return fmt.Errorf("lazyfork_root is empty: %w", errdefs.ErrInvalidArgument)
	case c.Address == "":
		return fmt.Errorf("address is empty: %w", errdefs.ErrInvalidArgument)
	case c.MemoryGCInterval < 0:
		return fmt.Errorf("memory_gc_interval %s is negative (0 turns the collection off): %w", time.Duration(c.MemoryGCInterval), errdefs.ErrInvalidArgument)
	case c.MemoryGCInterval > 0 && c.MemoryGCInterval < Duration(10*time.Millisecond):
		// A bare TOML number decodes as nanoseconds.
		return fmt.Errorf("memory_gc_interval %s is too short: at least 10ms, written with a unit, as in \"90s\" or \"5m\" (a bare number is nanoseconds; 0 turns the collection off): %w", time.Duration(c.MemoryGCInterval), errdefs.ErrInvalidArgument)
	case c.Address == c.ttrpcAddress():
		return fmt.Errorf("address and ttrpc_address are both %s: %w", c.Address, errdefs.ErrInvalidArgument)
	}
	for _, a := range []string{c.Address, c.ttrpcAddress()} {
		// sun_path is 108 bytes including the NUL.
		if len(a) > 107 {
			return fmt.Errorf("socket path %s is %d bytes, longer than a unix socket allows (107): %w", a, len(a), errdefs.ErrInvalidArgument)
		}
	}
	return nil
}
