// Command purger is the workload of the madvise-guard container tests: it
// holds a buffer of patterned private anonymous memory and, on SIGUSR1,
// purges the buffer's next chunk with madvise(MADV_DONTNEED), the call an
// allocator makes to give memory back, and reports what the call returned
// and what the memory reads afterwards. It prints:
//
//	ready addr=A chunks=N chunk_bytes=B
//	tick N
//	purge chunk=K rc=ok|ERRNO zero=1|0 intact=1|0
//
// zero: the purged chunk reads zeros. intact: every earlier purged chunk
// reads zeros and every other chunk its pattern. It is built static
// (CGO_ENABLED=0) and bind-mounted into a busybox container.
package main

import (
	"encoding/binary"
	"errors"
	"fmt"
	"os"
	"os/signal"
	"syscall"
	"time"

	"golang.org/x/sys/unix"
)

const (
	chunks     = 8
	chunkBytes = 4 << 20
)

func word(i int) uint64 { return uint64(i)*0x9E3779B97F4A7C15 ^ 0x5bd1e995 }

func main() {
	buf, err := unix.Mmap(-1, 0, chunks*chunkBytes, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS)
	if err != nil {
		fmt.Fprintln(os.Stderr, "purger: mmap:", err)
		os.Exit(1)
	}
	for i := 0; i+8 <= len(buf); i += 8 {
		binary.LittleEndian.PutUint64(buf[i:], word(i/8))
	}
	purged := 0
	sig := make(chan os.Signal, 4)
	signal.Notify(sig, syscall.SIGUSR1)
	fmt.Printf("ready addr=%x chunks=%d chunk_bytes=%d\n", &buf[0], chunks, chunkBytes)
	tick := time.NewTicker(100 * time.Millisecond)
	for n := 1; ; n++ {
		select {
		case <-tick.C:
			fmt.Printf("tick %d\n", n)
		case <-sig:
			if purged == chunks {
				fmt.Println("purge chunk=none")
				continue
			}
			k := purged
			c := buf[k*chunkBytes : (k+1)*chunkBytes]
			rc := "ok"
			if err := unix.Madvise(c, unix.MADV_DONTNEED); err != nil {
				var errno syscall.Errno
				if errors.As(err, &errno) {
					rc = unix.ErrnoName(errno)
				} else {
					rc = "error"
				}
			}
			zero := allZero(c)
			if rc == "ok" {
				purged++
			}
			fmt.Printf("purge chunk=%d rc=%s zero=%d intact=%d\n", k, rc, boolInt(zero), boolInt(intact(buf, purged)))
		}
	}
}

func allZero(b []byte) bool {
	for _, c := range b {
		if c != 0 {
			return false
		}
	}
	return true
}

// intact reports whether the first purged chunks read zeros and the rest
// their pattern.
func intact(buf []byte, purged int) bool {
	if !allZero(buf[:purged*chunkBytes]) {
		return false
	}
	for i := purged * chunkBytes; i+8 <= len(buf); i += 8 {
		if binary.LittleEndian.Uint64(buf[i:]) != word(i/8) {
			return false
		}
	}
	return true
}

func boolInt(b bool) int {
	if b {
		return 1
	}
	return 0
}
