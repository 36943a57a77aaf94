// Package memfile turns a CRIU dump's private anonymous memory into shared,
// immutable files on a tmpfs, so that every restore of the dump maps those
// files MAP_PRIVATE: the page cache is shared by all copies and the kernel
// copies a page only when a copy writes it. It also keeps the family store:
// where the files live, who references them, and when they may be freed.
//
// # The rewrite
//
// [Store.Rewrite] reads inventory, pstree, files, mm, pagemap and pages
// images (package criuimg). Every VMA that is private anonymous and holds
// pages becomes a private mapping of a region of a new memory file; its
// pages leave the image. These stay as they are: the stack (recognised by
// MAP_GROWSDOWN: CRIU refuses a growsdown file mapping and the status bits
// do not mark it), vdso, vvar, vsyscall, AIO rings, SysV/memfd/shadow-stack
// areas, hugetlb areas, wipe-on-fork VMAs (below) and VMAs without pages
// (guard pages, PROT_NONE reservations).
//
// With RewriteOptions.FileRoot set, a dirty private file mapping (a
// program's or library's .data) is converted too; see below.
//
// # CRIU's network lock
//
// A restore takes its network lock method from the dump's inventory. For a
// task with its own network namespace the lock and unlock run
// iptables-restore four to eight times, about 70 ms of every restore, to
// keep packets away from TCP connections CRIU repairs. Unless the image holds
// such a connection (a TCP socket neither listening nor closed: a dump with
// --tcp-established), the rewrite sets the method to skip.
//
// # Empty tmpfs mounts
//
// CRIU refills every tmpfs a container mounts by running tar and gzip on
// restore, about 8-15 ms a mount, though most (/dev/shm, /run, the masked
// /proc/acpi and /sys/firmware) hold nothing. The rewrite turns each tmpfs
// superblock whose dumped contents are its root directory alone, with the
// mode and owner its options give a new tmpfs, into a plain new mount
// (fstype "auto", fsname tmpfs) and drops its tar image; mounts with contents
// (runc's /dev) keep CRIU's path. See autoMountEmptyTmpfs.
//
// # Wipe-on-fork memory
//
// CRIU neither records nor restores MADV_WIPEONFORK: it dumps such memory
// like any other, so every copy would start with the parent's bytes there.
// That is where Go ≥1.24 and glibc ≥2.41 keep their vDSO getrandom state,
// and copies sharing it draw the same "random" numbers. The advice is only
// visible in /proc/PID/smaps of the live process, so the caller reads it
// ([ReadWipeOnFork], around the dump) and passes it in
// RewriteOptions.WipeOnFork: each private anonymous VMA inside those ranges
// loses its pages (a copy reads zeros, as a fork() child does, and the vDSO
// reseeds from the kernel) and gets the advice back in its VmaEntry, which
// CRIU's restorer applies. MAP_DROPPABLE (the state's other flag) cannot be
// restored: the copy's state is ordinary memory, at most a few pages.
//
// The converted VMA records the file as CRIU's checks demand: a reg-file
// entry with the path under RewriteOptions.MapDir, and the exact size and
// mode the file has on disk (0400, sealed: never touched again). In a dump that has
// its own mount namespace the entry carries the mnt_id of the mount that
// holds MapDir (CRIU opens the path relative to that mount's root).
//
// All the VMAs that map the new memory file share that one entry (one file
// id), as in a dump of a restored copy: CRIU keeps the file open for a run
// of consecutive mappings of one file id. Mappings of other files between
// them still make it open the file again for each run, and it holds every
// file it opened until its restorer maps them: a task whose image would hold
// more than 256 open files at once gets an empty parent pagemap, so that
// CRIU premaps its mappings one file at a time (see premap.go; 100,000
// alternating file and anonymous mappings restore, TestManyMappings).
//
// # Layout: one slot per VMA
//
// One memory file per rewrite, shared by the whole process tree. Each
// converted VMA owns a slot of SlotSize (1 TiB) bytes: its pages at the
// start of the slot, holes after them. Consequences:
//   - mremap growth of a whole VMA (in place or moved) reads the slot's
//     holes: zeros, as it would for anonymous memory; no SIGBUS either, since
//     the file is as long as all its slots. In a guarded copy the madvise
//     guard stops mremap of converted memory (below).
//   - No two VMAs map adjacent file offsets, so the kernel never merges two
//     of them into one VMA whose growth would expose the neighbour's bytes
//     (the bug of an earlier layout with adjacent slots).
//   - Holes cost nothing until touched. A read of a hole inside a VMA (a
//     page the process never touched) allocates a page in the file (shmem
//     semantics), charged to the copy that touched it; pages that were in the
//     dump are never holes. The page a hole gets is shared by every copy that
//     touches it later and stays in the file (charged to the first toucher).
//
// # Dirty .data of programs and libraries
//
// Every process has writable private mappings of its binary and shared
// libraries (.data, .got): the pages it wrote are anonymous copies, which
// CRIU dumps and restores as anonymous memory in each copy (about 1.1 MB for
// python3.11). With RewriteOptions.FileRoot (the container's rootfs, "/" for
// plain processes) such a VMA becomes a private mapping of a slot holding
// the file's bytes for its range with the dumped pages on top, shared by
// every copy like a converted anonymous VMA; its pages leave the image.
// Converted: regular MAP_PRIVATE file mappings, writable and not
// executable, not growsdown/hugetlb/WIPEONFORK, that have dumped pages (a
// clean one stays a mapping of its file: a slot would only cost page cache),
// of a file the same task also maps executable (a program or library it
// runs; a data file mapped privately stays as is, since its clean pages
// follow later write()s to the file and a slot would not).
//
// The file's bytes are used only if they are the bytes the dumped process
// saw; otherwise the VMA stays as it is. The reg-file the VMA maps must be:
// not remapped (remap-fpath: deleted or linked-remap files); on the
// container's root mount (its mnt_id is the one of mountpoint "/"; the
// path is opened with openat2 RESOLVE_IN_ROOT, and RESOLVE_NO_XDEV in a
// container, so neither a symlink nor another mount leads elsewhere); a
// regular file with exactly the size and mode CRIU recorded; with a ctime
// not later than the dump's earliest image file (ctime cannot be set back;
// CRIU's own build-id check would pass an in-place edit of .data); and the
// VMA must not reach past the file's last page (the original would SIGBUS
// there, the slot reads zeros). The file is checked again after it was
// copied (size and ctime), and a change fails the rewrite. This assumes the
// images were written by CRIU where they are (their mtimes date the dump).
//
// In a copy, /proc/PID/maps names the memory file instead of the library.
// A dump of a copy sees a mapping of a family file: its writes are a delta
// as below; parents and children share slots by the rule below (same file
// at the same offsets).
//
// # Process trees
//
// Tasks are handled parents first. A child's VMA that ends where its
// parent's converted VMA ends (and starts inside it) is compared page by
// page with the parent's region of the file; if at most RebaseRatio of the
// compared pages differ, the child maps the same region and keeps exactly
// the differing pages in the image (pages it lacks but the region has are
// kept as zero pages). Otherwise it gets its own slot. CRIU's own
// copy-on-write between parent and child still works: the child's VMA has
// the parent's file id and offset, which is what CRIU's check_cow_vmas
// matches; CRIU then shares by comparison the pages both list, and drops
// (MADV_DONTNEED: back to the file's bytes) the parent's pages the child
// does not list, which is why the child lists every page where it differs
// from the file, even one equal to its parent's.
//
// CRIU's check ignores the file offset, and both the rewrite and a dump of
// a restored copy give one file id to every mapping of a memory file. So a child VMA that maps a
// different region at the same addresses as its parent's VMA would be
// restored with the parent's contents; the rewrite gives such a VMA a file
// id of its own (a clone of the files.img entry).
//
// # Forks of forks
//
// Dumping a restored copy writes only its copy-on-write pages for the file
// mappings (CRIU skips page-cache pages). The rewrite of such a dump leaves
// those pages in the image as a delta on top of the same files: a VMA maps
// exactly one file range, so moving a delta into a file of its own would mean
// copying the whole region anyway, while CRIU restores a small delta in
// microseconds. New anonymous memory of the copy is converted into a new
// file as usual. When the delta exceeds RebaseRatio (default 1/4) of the data
// pages the snapshot maps from files, the snapshot is rebased: every file
// mapping is rewritten into fresh slots (file data plus delta), and the old
// files are no longer referenced by it. SnapshotInfo.Parent names the newest
// file a delta sits on.
//
// # Patched deltas
//
// With RewriteOptions.Patch (patch.go), for a parent that runs on its files
// and is not moved again, a family mapping's pages become patches instead of
// a delta: the VMA is split into its base file around patches, runs of its
// written pages (joined across gaps under 4 pages) mapped from slots of the
// new memory file, or, where PatchOptions.Previous (the previous snapshot's
// Result.Patches) holds a patch whose bytes are exactly what the process
// shows there, from that patch's file again. Its pages leave the image, so
// no copy restores them privately; a snapshot with nothing new writes no
// file. A patched rewrite never rebases. A reused file that was freed after
// it was read fails the commit (ErrAborted: rewrite again without it).
//
// # Atomicity
//
// The memory file is written under a temporary name (.tmp-*, flocked by its
// writer) and renamed into place and sealed at commit, under the family lock
// (which GC takes too), just before the RewriteOptions.Stage hook runs. The new image is built in a
// staging directory beside imageDir (unchanged files hard linked), including
// lazyfork.json, then swapped with imageDir by one renameat2(RENAME_EXCHANGE):
// whatever moment a rewrite dies at, imageDir is either the old image, intact,
// or the whole snapshot. Leftovers (a staging directory, a .tmp file whose
// writer is gone, a holder whose image has no lazyfork.json) are removed by
// the next rewrite of that directory and by GC.
//
// # The phases
//
// Store.Rewrite runs five phases, each a function of what the previous ones
// produced: loadDump (load.go) reads the images and classifies every VMA;
// planVMAs (plan.go) decides what converts and whether to rebase;
// writeMemory (layout.go, copy.go) lays the converted VMAs out in the new
// memory file, a PendingFile of the store, and copies their pages in;
// stageImage (stage.go) builds the new image beside the old; and
// Store.commitRewrite (commit.go) is the store's part: name, seal,
// reference, swap. The commit has fixed fault points where tests make the
// rewrite fail or die (faultPoints).
//
// # The store and references
//
// Files live in <root>/<family>/; references in <root>/.state/<family>/refs,
// one small JSON file per holder listing the files it pins, changed under an
// flock of the family. A file is freed (by Unref or GC) only when no live
// holder lists it and no process maps it (GC scans /proc/*/maps for the
// file's device and inode, so even a copy nobody registered pins its files:
// unlinking a file under a running copy would make its next dump fail,
// CRIU cannot dump a mapping of an unlinked file). Holders:
//   - "snapshot:<imageDir>": alive while imageDir/lazyfork.json names the
//     family (the default holder of a rewrite);
//   - "pid:<pid>": alive while that process lives (its start time is
//     recorded, so a recycled PID does not count);
//   - anything else (e.g. "container:<ns>/<id>"): alive until Unref.
//
// # Sealing
//
// Memory files are the ground truth of every running copy: a changed byte
// changes every copy that has not written that page, a truncation kills them
// with SIGBUS. Once a rewrite names its memory file (commit), the file gets
// the immutable attribute (FS_IMMUTABLE_FL, chattr +i; tmpfs and ext4 have
// it, setting it needs CAP_LINUX_IMMUTABLE): nobody, root included, may then
// open it for writing, truncate, chmod, rename, link or unlink it until the
// flag is cleared. Where the filesystem or the caller cannot seal (a
// non-root test on a t.TempDir), files stay unsealed (debug log). Only the
// store clears the flag, for the unlink of GC or of an aborted rewrite and
// for the link of a view, and sets it again while the inode has other
// links. [Seal], [Unseal]; [RemoveAll] removes trees holding sealed files
// (purges, teardowns, test cleanup). [Store.Verify] checks cheaply, without
// reading data, that files are present, regular, 0400, not empty, and
// sealed where this store can seal (found by sealing a probe file once);
// each problem is an errdefs.ErrDataLoss error naming the file.
//
// # Owners
//
// A family belongs to one containerd namespace: [Store.Claim] records the
// first claimant ([Owner]: namespace, the container that started the family,
// time) in <root>/.state/<family>/owner.json under the family lock; a claim
// by the same namespace succeeds, one by another namespace is an
// errdefs.ErrAlreadyExists error naming both. [Store.Owner] reads it
// (ErrNotFound when unowned).
//
// # Views
//
// A family is not a trust boundary: its directory holds the deltas of every
// member. A container therefore gets a view instead: <root>/.views/<view>
// ([Store.ViewDir], the name from [ViewName](namespace, id), 32 hex digits
// of a sha256), a directory of hard links to exactly the files of its own
// lineage ([Store.LinkView], idempotent, under the family lock). Links share
// the inode, hence the page cache, with the family file; a file the family
// gets later (a sibling's delta) is not in the view. Entries of the view
// that LinkView did not make (the shim's vm.overcommit_memory file) are left
// alone. [Store.RemoveView] removes the view, links and all.
//
// # Lifetime of a family
//
// GC and Unref work by name in the family directory and by device and inode
// in /proc/*/maps, so a copy mapping a file through its view still pins it;
// the .views and .state directories are not families (names starting with a
// dot are not valid family names). A file freed from the family while a view
// still links it lives on, sealed, until the view goes. A family with no
// files (none being written either), no live holder and no view is removed
// by GC (or by the Unref or RemoveView that emptied it), with its state
// directory and owner record: a family that has no files yet (a container
// started, not snapshotted) keeps its owner only while something holds it,
// Ref(family, holder, nil) or a view (LinkView with no files). The lock file
// goes last, and lockFamily relocks if the file it waited on was removed.
//
// # Not supported
//
// Incremental (pre-dump, parent images) and lazy-pages dumps: pages outside
// the image are an ErrNotImplemented error.
//
// Programs that count on MADV_DONTNEED zeroing memory: in a copy, DONTNEED
// on a private file mapping brings back the file's bytes, not zeros. jemalloc
// does (docs/allocators.md), and so does the Go runtime from Go 1.26 on: it treats
// scavenged pages as already zeroed (runtime/mheap.go, initSpan) and hands
// out stale bytes in a copy (measured: the goheap workload fails its zero
// check in every copy). The madvise guard of package memfile/madvguard,
// applied through RewriteOptions.Stage, makes such calls fail; jemalloc then
// memsets and Go falls back to mmap(MAP_FIXED|MAP_ANONYMOUS) (measured: the
// Go workload passes).
//
// mremap growth of part of a VMA: if the kernel had merged two anonymous
// mappings into one VMA before the dump, growing the first one moves it and
// its new tail shows the second one's bytes instead of zeros. The boundary
// between the two is nowhere in the dump, and a VMA maps one contiguous file
// range, so no layout can hide it; and a VMA moved by mremap leaves the
// guarded addresses, so a later purge there would bring back the file's
// bytes. The guard therefore also stops mremap of converted memory: refuse
// mode fails a growth into data and any move by flag (MREMAP_FIXED,
// MREMAP_DONTUNMAP); zero mode has the supervisor turn the converted part of
// the old range into anonymous memory with the same bytes first, then rerun
// the call (fidelity TestMremapInCopies). Growth of a whole VMA reads zeros.
package memfile
