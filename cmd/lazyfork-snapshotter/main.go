// Command lazyfork-snapshotter is LazyFork's containerd proxy snapshotter.
package main

import (
	"context"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"syscall"
	"time"

	"github.com/containerd/log"

	"github.com/lazyfork/lazyfork/snapshotter/server"
)

// version is set with -ldflags "-X main.version=...".
var version = "dev"

const usage = `lazyfork-snapshotter: LazyFork's overlay snapshotter for containerd, with frozen
layers that forks of a running container stack on.

Usage: lazyfork-snapshotter [flags]

It serves containerd's snapshots gRPC API on --address and LazyFork's own ttrpc
API on <address>.ttrpc: lazyfork.v1.Snapshotter (Status) and lazyfork.v1.Node,
what the lazyfork CLI and the Go SDK need of LazyFork's root (--lazyfork-root):
with that socket and containerd's, a client needs nothing else of the node. The
shims ask it too, for a pod's lazyfork.io/fork-of of a running container or a kept
snapshot (it snapshots through the shim's containerd): give it the shims'
LAZYFORK_ROOT, and serve the ttrpc API at <that root>/snapshotter.sock.ttrpc (as
lazyfork setup does) or set the shims' LAZYFORK_API. Register it in containerd's config.toml:

  [proxy_plugins.lazyfork]
    type = "snapshot"
    address = "/run/lazyfork/snapshotter.sock"
    [proxy_plugins.lazyfork.exports]
      root = "/var/lib/lazyfork/snapshotter"

and use it with: ctr run --snapshotter lazyfork ... (or the Go client's WithSnapshotter).

Every --memory-gc-interval it frees what lazyfork gc would in LazyFork's memory
store: memory files that no live task or snapshot references and no process
maps, and the references and views of tasks containerd removed without their
shim's delete (a shim killed while it created the task).

Signals: SIGTERM stops after the calls in flight finish (use it for restarts and
upgrades); SIGINT cancels them (a cancelled freeze leaves nothing behind). Neither
touches layers or mounts: running containers keep working, and the next start
reconciles the root.

Flags (they override the --config file):
`

func main() {
	cfg := server.DefaultConfig()
	fs := flag.NewFlagSet("lazyfork-snapshotter", flag.ContinueOnError)
	fs.Usage = func() {
		fmt.Fprint(fs.Output(), usage)
		fs.PrintDefaults()
		fmt.Fprint(fs.Output(), `
Config file (TOML; every key optional):

  root = "/var/lib/lazyfork/snapshotter"
  address = "/run/lazyfork/snapshotter.sock"
  ttrpc_address = ""        # default: <address>.ttrpc
  lazyfork_root = "/run/lazyfork"  # LazyFork's root, served by the node API
  mount_options = []        # added to every overlay mount
  async_remove = false      # free removed layers in Cleanup (after containerd's GC)
  log_level = "info"
  memory_gc_interval = "1m" # free memory files nothing holds (as lazyfork gc does); "0": never
`)
	}
	configPath := fs.String("config", "", "TOML config file")
	root := fs.String("root", cfg.Root, "directory of the layers and metadata")
	address := fs.String("address", cfg.Address, "unix socket for containerd's snapshots gRPC API")
	lfRoot := fs.String("lazyfork-root", cfg.LazyForkRoot, "LazyFork's root (the shim's LAZYFORK_ROOT) that the node API serves")
	ttrpcAddress := fs.String("ttrpc-address", "", "unix socket for the lazyfork.v1 ttrpc API (default <address>.ttrpc)")
	logLevel := fs.String("log-level", cfg.LogLevel, "trace, debug, info, warn or error")
	gcInterval := fs.Duration("memory-gc-interval", time.Duration(cfg.MemoryGCInterval), "how often to free the memory files of LazyFork's root that no live task or snapshot holds (0: never; lazyfork gc does it on demand)")
	showVersion := fs.Bool("version", false, "print the version and exit")
	if err := fs.Parse(os.Args[1:]); err != nil {
		if err == flag.ErrHelp {
			os.Exit(0)
		}
		os.Exit(2)
	}
	if fs.NArg() > 0 {
		fmt.Fprintf(os.Stderr, "lazyfork-snapshotter takes no arguments (got %q); see --help\n", fs.Args())
		os.Exit(2)
	}
	if *showVersion {
		fmt.Println("lazyfork-snapshotter", version)
		return
	}
	if *configPath != "" {
		var err error
		if cfg, err = server.LoadConfig(*configPath); err != nil {
			fmt.Fprintln(os.Stderr, "lazyfork-snapshotter:", err)
			os.Exit(2)
		}
	}
	// Flags given explicitly win over the file.
	fs.Visit(func(f *flag.Flag) {
		switch f.Name {
		case "root":
			cfg.Root = *root
		case "address":
			cfg.Address = *address
		case "lazyfork-root":
			cfg.LazyForkRoot = *lfRoot
		case "ttrpc-address":
			cfg.TTRPCAddress = *ttrpcAddress
		case "log-level":
			cfg.LogLevel = *logLevel
		case "memory-gc-interval":
			cfg.MemoryGCInterval = server.Duration(*gcInterval)
		}
	})
	if err := run(cfg); err != nil {
		fmt.Fprintln(os.Stderr, "lazyfork-snapshotter:", err)
		os.Exit(1)
	}
}

func run(cfg server.Config) error {
	if err := log.SetLevel(cfg.LogLevel); err != nil {
		return fmt.Errorf("log level %q: %w", cfg.LogLevel, err)
	}
	ctx := context.Background()
	srv, err := server.New(ctx, cfg, version)
	if err != nil {
		return err
	}
	sigs := make(chan os.Signal, 2)
	signal.Notify(sigs, syscall.SIGTERM, syscall.SIGINT)
	go func() {
		sig := <-sigs
		graceful := sig == syscall.SIGTERM
		log.G(ctx).WithField("signal", sig).WithField("graceful", graceful).Info("stopping")
		go func() {
			// A second signal while waiting stops at once.
			<-sigs
			srv.Cancel()
		}()
		srv.Stop(ctx, graceful)
	}()
	return srv.Serve(ctx)
}
