// Package harness runs a private containerd for integration tests and benchmarks.
//
// # What it starts
//
// Start launches the containerd found on PATH (v2.4.x) with a generated config
// (version 3) whose root, state, sockets, shim socket dir, runc root, CNI dirs and
// opt dir all live under one short temporary directory (unix socket paths must stay
// under 108 bytes, shim socket dirs under 43). Nothing outside that directory is
// touched except the cgroups of the containers it runs, which all sit under one
// cgroup parent unique to the harness (CgroupParent), so that teardown can be exact.
// `imports = []` keeps the host's /etc/containerd out; NRI is disabled; CRI is
// disabled unless Options.EnableCRI.
//
// Options are built so later parts of LazyFork slot in: BinDirs are prepended to
// containerd's PATH (so `io.containerd.lazyfork.v1` finds
// `containerd-shim-lazyfork-v1`), Runtimes add CRI runtime handlers, ProxyPlugins add
// `[proxy_plugins.NAME]` entries, and ExtraTOML is appended verbatim.
//
// # Teardown
//
// Stop (and the t.Cleanup installed by StartT) removes everything the harness caused:
// every task is killed (SIGKILL) and deleted, every container deleted with its
// snapshot, containerd stopped, any shim still serving this containerd killed by PID
// (found by scanning /proc for its exact -address), any process left in the
// harness's cgroups killed, mounts under the temporary directory detached, the
// cgroups removed (v1 hierarchies and v2 alike) and the directory deleted.
// Containers made outside NewContainer (e.g. pods through CRI) are cleaned up
// exactly only if they also use CgroupParent (linux.cgroupsPath, CRI's
// cgroup_parent) and FIFODir for FIFO-based IO.
//
// A test that crashed (timeout, panic, SIGKILL) never ran its teardown. Each
// harness dir records its owner process (PID and start time); the next Start
// reaps (ReapOrphans) every harness dir whose owner is gone, and Reap, or
// `go run ./integration/harness/cmd/lfh-reap /tmp/lfh-ID-N`, does it by hand.
//
// # Tasks and images
//
// NewContainer creates containers with the harness's runc root and cgroup parent;
// NewTask creates tasks whose stdout and stderr go to a log file (cio.LogFile) under
// the harness directory, so tasks survive the caller and their output can be
// waited on with WaitLine. ImportImage imports the test images built and cached by
// scripts/images.sh (`busybox`, `python`), building them first if needed.
package harness
