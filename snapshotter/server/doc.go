// Package server runs lazyfork-snapshotter: containerd's snapshots gRPC API
// (what [proxy_plugins.lazyfork] connects to) on one unix socket and the
// lazyfork.v1 ttrpc API on a second one, over one snapshotter.Snapshotter.
//
// # Stopping
//
// The snapshotter holds no mounts (containerd mounts what Prepare returns),
// so stopping it never disturbs running containers, and a restart picks up
// the same root. Stop(graceful=true), what SIGTERM does, lets calls in flight
// (a freeze copy can take seconds) finish; Stop(false), what SIGINT does,
// cancels them, and each cancelled freeze removes its partial copy.
//
// # Memory collection
//
// The server also runs the memory store's GC of LazyFork's root (what
// lazyfork gc ends with) at its start and every Config.MemoryGCInterval.
// A task removed without its shim's delete (its shim killed while creating
// it) leaves a reference and a view that pin a memory file, possibly a whole
// heap; nothing else would free it until someone ran lazyfork gc.
package server
