// Package shim is LazyFork's containerd runtime shim, io.containerd.lazyfork.v1.
//
// # Shape
//
// The shim is containerd's runc shim with a thin layer on top: the task service
// wraps the runc task service (create, start, exec, kill, pause, resume, metrics,
// delete, OOM events, stdio and TTY are runc's own code), and the manager wraps
// runc's manager (bootstrap, sockets, `delete`). What LazyFork adds:
//
//   - Every container belongs to a family (a root container and all its forks),
//     which belongs to its containerd namespace (trust.go). On Create the
//     container's own memory view (memfile.LinkView: links to the files its
//     snapshot maps, nothing else) is bind-mounted read-only at /.lazyfork/mem
//     (memfile.MountPath) into the bundle's config.json, so the mount is part of
//     every dump and every restore and is external to CRIU.
//   - vm.overcommit_memory reads 2 inside the container: a createContainer hook
//     (this binary, see RunHook) bind-mounts a file that lives inside the family
//     memory view over /proc/sys/vm/overcommit_memory, so CRIU sees it as a
//     bind of the external mount and it survives checkpoint and restore.
//   - Checkpoint (leave-running unless runc options say otherwise) runs runc's
//     checkpoint, then rewrites the image with memfile so its private anonymous
//     memory lives in the family's files; the image path is then a small
//     LazyFork snapshot. A caller that paused the task may ask, in LazyFork's
//     checkpoint option (api.MarshalCheckpointOptions), for the task to be
//     thawed right after the dump; the source record says when it was.
//   - Create with a LazyFork snapshot as checkpoint takes a reference on the
//     snapshot's memory files for the container (dropped on delete) and lets
//     runc restore it at Start, mapping the files MAP_PRIVATE.
//   - A container annotated lazyfork.io/fork-of (a Kubernetes pod's container,
//     through CRI) is created from the named LazyFork snapshot, from a
//     checkpoint archive containerd wrote, unpacked under ROOT/snapshots, or
//     from a running container of its namespace, snapshotted through
//     containerd by lazyfork-snapshotter's node API (SnapshotForPod), so the
//     shim links no containerd client (forkof.go).
//   - A root container has a shim of its own; forks carrying the same
//     lazyfork.io/shim-group share one (manager.go), so a dying shim takes
//     down one group, never the parent.
//   - Before the dump of a frozen container, its memory moves onto a memory
//     file of its family in place (rehome.go, memfile/rehome), so it holds its
//     heap once and its next snapshot is a delta.
//
// # Configuration
//
// The shim is started by containerd and inherits its environment:
//
//	LAZYFORK_RUNC_ROOT   runc's state root when runtime options give none (default /run/containerd/runc)
//	LAZYFORK_CGROUP_PARENT  parent of the cgroups of containers with containerd's default
//	                     cgroupsPath /NAMESPACE/ID (PARENT/NAMESPACE/ID); setup sets both for
//	                     a private stack, so that two stacks share neither
//	LAZYFORK_ROOT        tmpfs root (default /run/lazyfork); memory files in ROOT/mem
//	LAZYFORK_TMPFS_SIZE  size of that tmpfs in bytes when LazyFork mounts it (default: half of RAM)
//	LAZYFORK_OVERCOMMIT  "2" (default), "0", "1", or "off" to leave the host's value visible
//	LAZYFORK_CRIU_VERBOSITY  CRIU log level for LazyFork containers, 0..4 (default 1: errors),
//	                     or "runc" for runc's own (4); passed as runc's org.criu.config
//	                     annotation unless the container sets one. CRIU restores inside the
//	                     fork's memory cgroup: a debug log is page cache charged to every fork.
//	LAZYFORK_MADVISE     madvise guard of checkpoints: "refuse" (default), "zero" or "off";
//	                     a container's lazyfork.io/madvise annotation wins.
//	LAZYFORK_ARCHIVE_DIRS  colon-separated directories lazyfork.io/fork-of may name
//	                     archives in (default /var/lib/kubelet/checkpoints)
//	LAZYFORK_RESTORE_TIMEOUT  bound of one restore, and of one move's helper (default 2m)
//	LAZYFORK_REHOME      "on" (default) or "off": move containers onto their memory
//	                     files at checkpoint (lazyfork.io/rehome=false opts one out)
//	LAZYFORK_PATCH_DELTAS  "on" (default) or "off": a container that moved stays on its
//	                     files at its later snapshots, its writes patches of its forks,
//	                     and moves again only to consolidate (patched.go); "off" moves it
//	                     at every snapshot (lazyfork.io/rehome=each-snapshot for one)
//	LAZYFORK_REHOME_STANDBY  how long a started move helper waits for the next move, so that
//	                     its start-up (12-20 ms) is not in the pause: a duration (default 1m;
//	                     at most one waits per shim) or "off"
//	LAZYFORK_PRECOPY     "on" (default), "off", or a size such as 64M: copy a container's
//	                     memory before its first move's freeze when a client announces
//	                     the snapshot and it holds at least that much (default 128M;
//	                     precopy.go), so that the move copies only what it wrote since
//	LAZYFORK_CRIU_KDAT   "off": no kernel-feature cache for CRIU where /run is not a
//	                     tmpfs (kerndat.go)
//	LAZYFORK_CRIU_PROXY  "off": runc's PATH is left alone, so runc runs CRIU twice per
//	                     checkpoint and restore, the first time only for its version,
//	                     and CRIU runs tar and gzip for every tmpfs mount it dumps
//	                     (criuproxy.go)
//	LAZYFORK_CGROUP_WARM "off": runc's and the move helper's cgroup migrations wait for a
//	                     whole RCU grace period of their own (cgroup.go, warmCgroupAttach)
//	LAZYFORK_DUMP_GATE   "off": a moving checkpoint starts runc after the move, not beside
//	                     it with CRIU held at a gate (dumpgate.go)
//	LAZYFORK_REHOME_BATCH "off": a move's helper injects its mmaps one by one instead of in
//	                     batches run by a stub it maps into the process (memfile/rehome)
//
// # CRIU's version check and empty tmpfs dumps
//
// runc asks CRIU for its version before every checkpoint and restore: a
// whole `criu swrk` run, a CRIU start-up of 3-5 ms, before the one that does
// the work. And CRIU dumps every tmpfs mount of a container with `tar
// --create --gzip` (a tar and a gzip process, 3-6 ms, inside the container's
// pause), although most are empty. The shim puts criu-proxy/ (beside this
// binary; `make build` and `make install` put the proxy, a static C program,
// cmd/lazyfork-criu-proxy/proxy.c, there as `criu` and `tar`) first on the
// PATH runc inherits, and passes in the environment the real CRIU (the first
// criu on the shim's PATH outside criu-proxy/), its identity (device, inode,
// size, mtime), its own answer to a VERSION request (asked once per CRIU
// binary and boot and kept beside the kernel-feature cache), and the real tar
// (likewise). As `criu` the proxy answers a VERSION request with that answer
// while the real CRIU's identity is unchanged; as `tar` it writes for CRIU's
// dump of an empty directory the archive GNU tar would. Anything else goes to
// the real program, untouched. The proxy, its directory, the real CRIU and
// tar, and the cache must be root-owned and writable by nobody else, or the
// proxy stays off (or, for the cache, the real CRIU is asked again).
//
// # The madvise guard
//
// Every checkpoint carries, unless turned off, the seccomp guard of
// memfile/madvguard on the memory-file ranges that hold data: in a restored
// copy, madvise(MADV_DONTNEED/MADV_FREE) there would bring back the file's
// bytes instead of zeros, and jemalloc and the Go runtime count on zeros. It
// is applied to the staged image inside the rewrite (RewriteOptions.Stage), so
// a snapshot appears with its guard or not at all; the parent is untouched.
// "zero" installs the trace form, and a fork restored from such a snapshot
// gets a supervisor (supervise.go: this binary re-executed, see
// madvguard.MaybeServe) that turns those calls into fresh anonymous mappings.
// It lets go while the fork is paused or dumped (CRIU cannot dump a traced
// task; a frozen one cannot be detached from) and attaches again after; with
// no supervisor attached the calls fail with ENOSYS, which allocators treat
// like a refusal.
//
// # Memory accounting
//
// The kernel charges a tmpfs page to the memory cgroup of the process that first
// writes it. A container's move writes its file from a helper that joins the
// container's memory cgroup, so the file is charged to the container whose
// memory it holds and its limit bounds its snapshots. Files the checkpoint
// rewrite writes (a fork's new memory) are charged to the shim's memory cgroup
// (containerd's, unless runc's ShimCgroup option puts the shim elsewhere),
// never to a fork: a fork's cgroup only holds the pages it writes itself plus
// what CRIU left anonymous. Each file's cgroup is recorded in the store
// (memfile.SetCharge); `lazyfork mem` and client.Families report it.
//
// # Per-container state
//
// Anything the `delete` subcommand or a later shim needs (family, reference
// holder, whether the task is a fork) is written atomically to the bundle's
// api.BundleStateFile.
package shim
