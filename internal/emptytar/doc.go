// Package emptytar answers CRIU's tar run for a tmpfs mount that holds
// nothing but its root directory, without running tar and gzip.
//
// CRIU 4.1 dumps every tmpfs mount of a container (/dev, /dev/shm, the
// read-only tmpfs runc mounts over masked directories) by running `tar
// --create --gzip` on it (criu/filesystems.c, tmpfs_dump): a tar and a gzip
// process per mount and per dump, 3-15 ms each, inside the container's
// pause, although most of those mounts are empty. A program first on CRIU's
// PATH (LazyFork's shim runs runc, and so CRIU, with its proxy directory
// first) calls Answer: for exactly CRIU's arguments and an empty directory
// on standard input it writes the archive GNU tar would (one "./" entry with
// the directory's mode, numeric owner and modification time, gzipped), and
// for anything else it reports false and the program runs the real tar. The
// rewrite then turns such mounts into plain new tmpfs mounts (memfile), and a
// plain restore extracts the archive as it would tar's.
package emptytar
