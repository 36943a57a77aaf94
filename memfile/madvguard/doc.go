// Package madvguard keeps memory-file copies correct under allocators that
// trust MADV_DONTNEED to zero memory.
//
// # Why
//
// In a restored copy, rewritten memory is a private mapping of a memory file.
// madvise(MADV_DONTNEED) there drops the copy's private pages and brings back
// the file's bytes, not zeros, and MADV_FREE fails. jemalloc marks a purged
// extent as zeroed when the purge succeeds, so calloc hands out stale bytes
// (about 30 % of callocs, from the first second). If the purge fails,
// jemalloc memsets.
//
// # What
//
// ApplyMode adds to a CRIU image a classic BPF seccomp filter for madvise
// with advice MADV_DONTNEED (4), MADV_FREE (8) or MADV_DONTNEED_LOCKED (24)
// whose [addr, addr+len) intersects one of the process's guarded ranges,
// and for mremap calls that grow or move guarded memory. A memory file's
// offsets run on past each part of a VMA, so growing part of a VMA (one the
// kernel had merged from two mappings before the dump, or whose tail was
// unmapped) maps the next part's bytes where anonymous memory reads zeros,
// and memory moved elsewhere leaves the guarded addresses, where a later
// purge would bring back the file's bytes (fidelity TestMremapInCopies).
// Refuse mode stops a growth whose new part's offsets hold data and any
// move by flag (MREMAP_FIXED, MREMAP_DONTUNMAP) of guarded memory; a
// MREMAP_MAYMOVE growth of a whole VMA works (the slot after it is a hole)
// and may move it, out of the guard (a later purge there is not caught).
// Zero mode stops every growth or move of guarded memory: the supervisor
// first turns the memory-file part of the old range into anonymous memory
// with the same bytes, so the call then works as on anonymous memory.
// CRIU restores seccomp filters from seccomp.img and the per-thread core
// images, so only restored copies carry the filter: the original keeps
// purging. The container's own filters are kept; ours is added on top, on
// every thread (in CRIU's TSYNC form when the image uses it). A guard
// already in the image (a copy of a copy was dumped) is recognised by the
// magic of its first instruction and replaced, never stacked: each
// generation holds exactly one.
//
// # Modes
//
// Refuse: the call fails with EINVAL. jemalloc memsets instead; glibc and
// mimalloc ignore the failure. Memory a copy frees inside the ranges stays
// resident.
//
// Zero: the call stops for a ptrace Supervisor (SECCOMP_RET_TRACE), which
// turns it into an anonymous mmap(MAP_FIXED) of the range: reads as zeros,
// memory given back, at the price of two ptrace stops per call. A stopped
// mremap is restarted after each part (at most 64 MiB) of its old range is
// made anonymous (copied through /proc/<tid>/mem, zero pages skipped);
// another thread using that memory meanwhile could see zeros for a moment,
// which a program moving memory another thread uses cannot count on anyway. Without a
// supervisor the call fails with ENOSYS, which allocators treat like
// Refuse, so a copy is correct whether or not one is attached. A traced
// copy cannot be dumped: the supervisor lets go for the dump and attaches
// again after it. So that no call runs untraced meanwhile, the copy is
// frozen across the gap: Hold stops every thread in a ptrace stop, the
// caller freezes the cgroup, Release detaches (each thread goes from its
// stop into the freezer); after the dump, Attach seizes the frozen threads
// and only then does the caller thaw them (TestHoldAcrossFreeze).
//
// # Ranges
//
// DataRanges lists, for a rewritten image, the ranges of memory-file
// mappings that hold data (SEEK_DATA on the files; holes read as zeros
// anyway). AnonRanges lists the anonymous ranges holding pages of a plain
// dump. Compact merges them to at most MaxRanges (each costs 12 BPF
// instructions on guarded calls only).
//
// # Crash safety
//
// ApplyMode replaces files only by rename (temp + fsync + rename), in an
// order that keeps the image restorable at every step: the new seccomp.img
// keeps every old filter at its index and appends the new chains, then each
// core image is switched to its new chain. It never writes a file in place,
// so it is safe on a staging directory hard-linked to the original, and it
// is idempotent. For an all-or-nothing result, call it on the staging copy
// before the copy is swapped into place (as a rewrite does).
package madvguard
