// Package node is what LazyFork's clients need of the node's root directory
// (api.Root: snapshots, the memory store's families, the journal of fork
// calls, their locks, logs), behind one interface, Node.
//
// Local works on the files directly: the shim (fork-of a running container)
// and on-node tools use it in-process. Service serves a Local over ttrpc
// (lazyfork.v1.Node, proto/lazyfork/v1/node.proto); lazyfork-snapshotter,
// the node daemon, serves it beside its Snapshotter service. Remote is the
// ttrpc client: with it and containerd's socket, the CLI and the Go SDK need
// nothing else of the node (another mount namespace, another host).
//
// Locks cross the API as streams: the server holds the flock while the
// client's stream is open and drops it when the client closes it or its
// connection ends, so a client that dies releases its locks as a process
// holding an flock does. A fork call is alive while it holds its lock
// "op:<id>"; that is how Reconcile tells a dead call's record.
package node
