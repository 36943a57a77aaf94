// Package client forks running containers through containerd and LazyFork's
// shim (runtime io.containerd.lazyfork.v1).
//
// # The SDK in five calls
//
//	c, err := client.Connect("/run/containerd/containerd.sock", "default")
//	defer c.Close()
//	agent, err := c.Container(ctx, "agent")   // name, id or unique id prefix
//	forks, err := agent.Fork(ctx, 10)         // ten running copies
//	defer forks.Close()                       // deletes them all
//	out, err := forks[0].Exec(ctx, "hostname") // its stdout
//	more, err := forks[0].Fork(ctx, 2)        // forks fork again
//
// Connect (and New) reach LazyFork's root on the node through its node API,
// lazyfork-snapshotter's ttrpc socket ($LAZYFORK_API, else
// api.DefaultAPISocket; WithAPI names another): with it and containerd's
// socket the SDK needs nothing else of the node (package node). On the node,
// WithRoot works on the root's files directly, in-process (the shim does).
//
// Stop snapshots a container and ends its process; Fork of a stopped
// container restores from that snapshot. Delete removes one container (its
// forks keep running). A container labelled lazyfork.io/hook (package hook)
// hears QUIESCE before each snapshot and every fork RESEED <its id> after
// its restore.
//
// # A fork, step by step
//
//	c := client.New(containerdClient, client.WithRoot("/run/lazyfork"))
//	res, err := c.Fork(ctx, "agent", 10)
//
// Then:
//
//  1. The parent's task is paused (cgroup freezer).
//  2. The parent's writable layer is captured while the task is frozen, so
//     files and memory agree: a frozen layer on LazyFork's snapshotter, else a
//     copy (ROOT/snapshots/<id>/upper); where is recorded in api.RootfsFile.
//  3. The shim checkpoints the task into ROOT/snapshots/<id>/image. Asked by
//     LazyFork's checkpoint option (api.MarshalCheckpointOptions), it thaws
//     the task right after CRIU's dump, then rewrites the image so its memory
//     lives in the family's memory files while the parent runs.
//  4. The parent is resumed, on every path, error or not (a no-op after the
//     shim's thaw), unless it was paused before Fork was called.
//  5. Each fork is a new containerd container: the parent's spec with its own
//     id and cgroups path, labels naming parent, family and snapshot
//     (api.LabelParent, ...), runtime api.RuntimeName, and a rootfs made of a fresh snapshot on the
//     parent's image plus a copy of the frozen writable layer. Its task is
//     restored from the snapshot directory (WithRestoreImagePath), mapping the
//     memory files copy-on-write. Forks share shims by groups (WithShimGroup)
//     of the family's forks, filling a shim an earlier call started while it
//     has room; a fork joins its group's running shim without containerd
//     running the shim binary for it (shimjoin.go, WithShimJoin).
//  6. Unless KeepSnapshot is given, the snapshot directory is removed once the
//     forks run: the forks hold their own references on the memory files.
//
// A fork of a fork is the same call on a fork. A failed Fork leaves the parent
// running and unpaused and removes every container, task, snapshot, directory
// and memory-file reference it made.
//
// # Root filesystem
//
// On LazyFork's snapshotter (containerd snapshotter "lazyfork"), the parent's
// writable layer becomes a frozen layer: the bulk copy runs before the pause,
// the catch-up while the task is frozen, and every fork stacks a fresh upper on
// that one layer (O(1) per fork). A kept snapshot pins its frozen layer
// (containerd.io/gc.root) until RemoveSnapshot.
//
// On any other snapshotter, a fork's rootfs is a fresh snapshot of the parent's
// image plus a copy of the parent's writable layer (taken while it is frozen,
// then copied into each fork); the parent must be on an overlay-style
// snapshotter whose mounts name an upperdir.
package client
