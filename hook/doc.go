// Package hook lets a program running in a LazyFork container take part in
// its snapshots: before a snapshot LazyFork asks it to QUIESCE (finish or
// park in-flight work, close connections that cannot survive a copy) and
// waits, bounded, for its answer; after each restore it tells the copy
// RESEED <id>, with the fork's container id, so the copy can reseed its
// random state and reconnect.
//
// # In the container (the runtime's side)
//
//	srv, err := hook.Listen(hook.SocketPath(), handler) // $LAZYFORK_HOOK
//	go srv.Serve()
//
// # Where the socket lives
//
// A container created with a hook (lazyfork create --hook DIR, or the label
// lazyfork.io/hook) gets the host directory DIR/<container id> bind-mounted
// at /run/lazyfork-hook and LAZYFORK_HOOK=/run/lazyfork-hook/hook.sock in
// its environment. The listening socket is part of every snapshot; a fork's
// spec points the same mount at its own host directory DIR/<fork id>, so
// CRIU binds the restored listener there and every copy has its own socket
// on the host at DIR/<id>/hook.sock.
//
// # Wire protocol
//
// One connection per message: LazyFork writes one line ("QUIESCE" or
// "RESEED <id>"), the runtime answers one line ("OK" or "ERR <reason>") and
// closes the connection. No connection stays open across a snapshot.
package hook
