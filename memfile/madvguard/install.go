package madvguard

import (
	"fmt"
	"unsafe"

	"golang.org/x/sys/unix"
)

// Install loads the guard for ranges into the calling process, on every
// thread (TSYNC). It needs CAP_SYS_ADMIN or no_new_privs; callers set the
// latter with unix.Prctl(unix.PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0). Tests and
// benchmarks use it to measure the filter without a restore.
func Install(ranges []Range, mode Mode) error {
	prog, err := Program(ranges, mode)
	if err != nil {
		return err
	}
	fp := unix.SockFprog{Len: uint16(len(prog)), Filter: &prog[0]}
	r, _, errno := unix.Syscall(unix.SYS_SECCOMP, unix.SECCOMP_SET_MODE_FILTER,
		unix.SECCOMP_FILTER_FLAG_TSYNC, uintptr(unsafe.Pointer(&fp)))
	if errno != 0 {
		return fmt.Errorf("seccomp(SET_MODE_FILTER): %w", errno)
	}
	if r != 0 { // TSYNC names the thread it could not synchronise
		return fmt.Errorf("seccomp(SET_MODE_FILTER): thread %d has foreign filters", r)
	}
	return nil
}
