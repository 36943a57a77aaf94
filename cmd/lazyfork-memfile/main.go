// Command lazyfork-memfile runs LazyFork's memory loop on a plain process tree and
// reports what it cost: start a program (or take a running one), dump it with CRIU,
// rewrite the dump so its memory lives in files on a tmpfs, restore N copies side by
// side (each in its own PID namespace), and print a table of timings and memory.
package main

import (
	"context"
	"fmt"
	"os"
	"os/signal"

	"golang.org/x/sys/unix"
)

func main() {
	cfg, err := parseFlags(os.Args[1:], os.Stderr)
	if err != nil {
		if err == errHelp {
			os.Exit(0)
		}
		fmt.Fprintln(os.Stderr, "lazyfork-memfile:", err)
		os.Exit(2)
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, unix.SIGTERM)
	defer stop()
	if err := run(ctx, cfg, os.Stdout); err != nil {
		fmt.Fprintln(os.Stderr, "lazyfork-memfile:", err)
		os.Exit(1)
	}
}
