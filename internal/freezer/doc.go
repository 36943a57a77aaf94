// Package freezer freezes and thaws a cgroup (the v1 freezer controller's
// freezer.state, or v2's cgroup.freeze) and waits until the kernel reports
// the new state, as runc's pause and resume do, without starting runc: the
// move's helper (memfile/rehome) and the shim's snapshot pauses
// (lazyforkv1.SnapshotIntent.freeze_in_shim) use it inside a pause, where a
// runc run is 15-20 ms of a Go program's start on a slow host.
package freezer
