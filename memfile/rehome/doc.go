// Package rehome moves a stopped process onto a memory file in place: its
// private anonymous memory becomes MAP_PRIVATE mappings of a file on tmpfs,
// the same mappings a restored fork gets, so its heap is held once (in the
// page cache, shared with its forks) and a later CRIU dump of it sees file
// mappings and dumps only the pages it wrote since (a delta).
//
// No restore is involved. While the process is stopped:
//
//	tr, _ := rehome.Seize(frozenCgroup, pid)       // ptrace-stop every thread
//	vmas, _ := rehome.Plan(pid)                    // which VMAs, which slots
//	done, st, err := tr.Move(pid, path, vmas, 0)   // copy + map, 64 MiB at a time
//	tr.InstallFilter(pid, prog)                    // optional: the madvise guard
//	tr.Detach()                                    // registers back, let go
//
// Move is Tracee.CopyPages (the process pwrites its pages into the file;
// with TracerCopies the tracer copies them) and Remap (injected
// openat+mmap+close) interleaved per chunk of each VMA.
// Done in one piece, the process's memory cgroup holds the heap twice
// (anonymous and in the file) before the mmap frees the anonymous copy: a
// process with a limit below twice its heap is OOM-killed in the middle
// (TestMoveInChunksUnderMemoryLimit shows it). In chunks, the excess is one
// chunk, and the chunks of a VMA merge back into one mapping.
//
// Tracee.CopyPages has the process write its own pages into the file with
// injected pwrite calls (one per run of held pages): the bytes are copied
// once, straight from its memory into the page cache, and the file's pages
// are charged to its own memory cgroup. The package-level CopyPages does
// the same from the caller (process_vm_readv + pwrite, in parallel), for a
// process that may not open the file for writing; Tracee.CopyPages falls
// back to it by itself. Tracee.TracerCopies has Move copy that way always
// (for a caller in the process's memory cgroup; the process's own pwrite is
// slow on some hypervisors, see its doc). The tracer leaves pages of zeros
// as holes (each VMA maps a slot of its own in a new file, which reads
// zeros there), except in prepared regions, whose slot holds older bytes.
//
// Plan selects private anonymous VMAs (no file, [heap], [anon:name]) that
// hold pages and are not a stack, locked, wipe-on-fork, hugetlb, shared,
// userfaultfd-registered, don't-fork, sealed or special (see skipFlags). As
// in the CRIU-image rewrite (memfile), VMA i owns slot i of the file, at
// offset i<<40: mremap growth reads zeros and no two VMAs map adjacent file
// offsets. Only pages present (other than the shared zero page) or
// swapped in /proc/pid/pagemap are copied: the rest stay holes.
//
// Injection (linux/amd64 only; elsewhere the Tracee methods return
// errdefs.ErrNotImplemented): all ptrace calls of a Tracee run on one
// locked OS thread. Seize PTRACE_SEIZEs every thread of each process and
// PTRACE_INTERRUPTs it; a process held by a frozen cgroup (v1 freezer or v2)
// is seized frozen and the cgroup thawed so the threads enter their stops
// (as CRIU's compel does), and frozen again by Detach before it lets go. A
// process stopped by SIGSTOP reports its group stop as a ptrace stop, which
// serves as well; Detach sends the stop signal again, as compel does. One thread per process (the main thread if alive)
// executes the injected calls: its registers and signal mask are saved,
// every signal is blocked while injecting, and each call sets rip to a
// `syscall` instruction found in the process's vDSO, rax and the argument
// registers, and orig_rax to -1 (so the kernel's restart logic leaves the
// injected call alone), then runs it with PTRACE_SYSCALL to its entry and
// exit stops and reads rax. Detach restores the saved registers with their
// orig_rax and the mask; PTRACE_DETACH wakes the thread through signal
// handling, where an interrupted nanosleep, poll, futex or read restarts as
// after any ptrace stop. Processes with seccomp filters are seized with
// PTRACE_O_SUSPEND_SECCOMP so their filters do not see the injected calls.
//
// A move's mmaps (hundreds after spread writes: one per patch) run in
// batches (batch_amd64.go): the process maps an anonymous r-x stub for the
// move, the tracer writes a loop and a table of calls into it through
// /proc/pid/mem, and runs it with PTRACE_CONT to the int3 at its end, every
// signal but SIGTRAP blocked (a blocked forced SIGTRAP would reset the
// process's handler). One ptrace round trip maps up to 1024 patches; the
// loop stops at the first call that does not return its address, which
// fails that VMA as a single call would. A process that ignores SIGTRAP
// gets one injected call per map; a SIGTRAP sent meanwhile is taken at the
// stub and sent again after, a stop signal again on Detach. The stub is
// unmapped at the end of the move.
//
// Remap writes the path into the target over the start of the first
// readable VMA it converts (already saved in the file, so the mmap brings
// the bytes back), opens the file, maps each VMA with MAP_PRIVATE|MAP_FIXED
// at its slot offset with its protection, and closes the file. A failed
// mmap leaves its VMA as it was (the kernel replaces a mapping only once the
// new one is ready; since 6.12 it also restores it on late failures); the
// path bytes are written back if their VMA stayed. The other VMAs are
// converted all the same, and the error lists the ones that stayed.
//
// InstallFilter loads a caller-supplied classic BPF program (e.g.
// madvguard.Program) with seccomp(SET_MODE_FILTER, TSYNC) from a scratch
// mapping it creates and removes by injection. The kernel demands
// CAP_SYS_ADMIN or no_new_privs from the installing thread (TSYNC then
// gives no_new_privs to the others); a process without the capability gets
// PR_SET_NO_NEW_PRIVS, and is listed in Tracee.NoNewPrivs.
//
// Consolidation (consolidate.go): patches split their mapping, so a
// process that writes pages spread over a moved heap ends up, move after
// move, with thousands of mappings, as do the forks restored from its dumps
// (391 bytes of kernel memory per mapping per copy, measured; and
// microseconds per mapping in every dump and move). Fragments finds runs of
// adjacent memory-file mappings, PrepareRegions copies them from their
// files (immutable) into a new file while the process runs, and a move of
// such a region (VMA.Prepared) checks the pieces are unchanged, writes the
// pages written since on top and maps the region whole. The shim prepares
// after a checkpoint's thaw and maps at the next move (shim/rehome.go).
//
// A first move can copy most of the heap before the freeze: PreCopy
// write-protects the VMAs through a userfaultfd made in the process
// (Tracee.Userfaultfd, asynchronous mode: nothing waits on it) and copies
// them while the process runs; the move reads the pages written since
// (PAGEMAP_SCAN, PAGE_IS_WRITTEN) and copies only those (VMA.PreCopied).
//
// What a converted process loses: the advice and properties of the
// anonymous VMAs that a file mapping cannot carry (MADV_HUGEPAGE, KSM
// merging, [anon:name] names); VMAs with properties that matter are left
// alone by Plan. A VMA with guard pages (MADV_GUARD_INSTALL) makes
// CopyPages fail.
package rehome
