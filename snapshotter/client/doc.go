// Package client is what a fork orchestrator needs from lazyfork-snapshotter,
// without pulling in the snapshotter itself.
//
// StartFreeze/Commit (or Freeze, both at once) make a frozen layer through
// any snapshots.Snapshotter: pass containerd's
// client.SnapshotService("lazyfork") so that containerd tracks the layer (its
// leases and GC then keep it exactly as long as something stacks on it).
// Commit (or Freeze) must run while the task using the active snapshot is
// frozen. Work under a lease (leases.WithLease) that lasts until the forks' snapshots are
// prepared on the frozen layer; without a lease containerd's GC may collect
// the frozen layer before the first fork stacks on it.
//
// The fork path, keeping the parent's pause short:
//
//	p, _ := client.StartFreeze(ctx, sn, parentKey, frozen) // task running: bulk copy
//	task.Pause(ctx)
//	// ... checkpoint ...
//	p.Commit(ctx)                                          // copies only what changed
//	task.Resume(ctx)
//	sn.Prepare(ctx, forkKey, frozen)                       // per fork: one mkdir
//
// Dial connects to the snapshotter's own ttrpc API (proto/lazyfork/v1).
package client
