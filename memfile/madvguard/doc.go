// Package madvguard keeps memory-file copies correct under allocators that
// trust MADV_DONTNEED to zero memory.
//
// # Why
//
// In a restored copy, rewritten memory is a private mapping of a memory file.
// madvise(MADV_DONTNEED) there drops the copy's private pages and brings back
// the file's bytes, not zeros, and MADV_FREE fails. jemalloc marks a purged
// extent as zeroed when the purge succeeds, so calloc hands out stale bytes
// (29-40 % of callocs in FACTS.md). If the purge fails, jemalloc memsets.
//
// # What
//
// Apply adds to a CRIU image a classic BPF seccomp filter (SECCOMP_RET_ERRNO
// with EINVAL) for madvise with advice MADV_DONTNEED (4), MADV_FREE (8) or
// MADV_DONTNEED_LOCKED (24) whose [addr, addr+len) intersects one of the
// process's rewritten ranges. CRIU restores seccomp filters from seccomp.img
// and the per-thread core images, so only restored copies carry the filter:
// the original keeps purging. The container's own filters are kept; ours is
// added on top, on every thread. A guard already in the image (a copy of a
// copy was dumped) is replaced, never stacked: each generation holds exactly
// one.
//
// # Cost
//
// A madvise call with another advice or outside the ranges pays a few BPF
// instructions per range; the ranges are merged (Compact) to at most
// MaxRanges. Memory a copy frees inside the ranges stays resident (it is
// memset instead of dropped).
//
// # Crash safety
//
// Apply replaces files one at a time, each atomically (temp + rename), in an
// order that keeps the image restorable at every step: the new seccomp.img
// keeps every old filter at its index and appends the new chains, then each
// core image is switched to its new chain. Apply is idempotent. For an
// all-or-nothing result, call it on the staging copy of an image before that
// copy is renamed into place (as memfile's Rewrite does).
package madvguard
