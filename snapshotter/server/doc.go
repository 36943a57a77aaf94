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
package server
