// Package criurun dumps and restores plain process trees with the criu binary.
//
// It is the plain-process side of LazyFork (no containerd, no runc): the developer
// tool, the fidelity tests and the memfile benchmark use it to dump a running
// program, and to restore many copies of the dump side by side.
//
// # Copies side by side
//
// A restored process gets back the PIDs it had when it was dumped, so two copies of
// one dump (or a copy next to its still running parent) collide, unless each lives in
// its own PID namespace. The trick: start the workload as the init (PID 1) of a new PID
// namespace ([Start] does this). CRIU then dumps the namespace along with the tree, and
// every restore creates a fresh namespace for its copy. Only the PID namespace is new:
// the workload shares the host's mount namespace, so CRIU never dumps mounts (a dumped
// mount namespace that sees the memory-file tmpfs would be tarred into the image), and
// memory files are opened at their host paths.
//
// The init of a PID namespace ignores every signal it has no handler for, SIGTERM
// included: stop copies with SIGKILL ([Kill]).
//
// # Standard output of copies
//
// CRIU records the size of every regular file a process has open and refuses to
// restore when the file changed size, which a log the parent keeps writing always
// does. [Dump] therefore records where the root's stdout and stderr went
// (criurun.json in the image directory), and [Restore] hands each copy a file of
// its own in their place with --inherit-fd (RestoreOptions.Stdout).
//
// # Reaping
//
// With --restore-detached, CRIU's child (the restored root) is re-parented when CRIU
// exits: to the nearest child subreaper, or to PID 1. A program that restores many
// copies should call [BecomeSubreaper] once, so that [Kill] can reap them.
package criurun
