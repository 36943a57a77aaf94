// Package procfs reads what LazyFork needs from /proc, in one place: a
// process's start time (which tells a live process from a reused PID) and
// its state.
package procfs

import (
	"fmt"
	"os"
	"strconv"
	"strings"

	"github.com/containerd/errdefs"
)

// Stat is the part of /proc/PID/stat LazyFork reads.
type Stat struct {
	// State is field 3: R, S, D, Z (zombie), X (dead), T, t, ...
	State byte
	// StartTime is field 22: clock ticks after boot when the process started.
	StartTime uint64
}

// Zombie reports whether the process has exited and waits to be reaped.
func (s Stat) Zombie() bool { return s.State == 'Z' || s.State == 'X' }

// ReadStat reads /proc/PID/stat. A missing process is an error wrapping
// errdefs.ErrNotFound.
func ReadStat(pid int) (Stat, error) {
	b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/stat")
	if err != nil {
		return Stat{}, fmt.Errorf("process %d: %w", pid, errdefs.ErrNotFound)
	}
	// comm (field 2) may hold spaces and parentheses: the fields after it
	// start after the last ')'.
	s := string(b)
	i := strings.LastIndexByte(s, ')')
	if i < 0 {
		return Stat{}, fmt.Errorf("process %d: malformed stat: %w", pid, errdefs.ErrDataLoss)
	}
	f := strings.Fields(s[i+1:])
	// f[0] is field 3; field 22 is f[19].
	if len(f) < 20 || len(f[0]) != 1 {
		return Stat{}, fmt.Errorf("process %d: malformed stat: %w", pid, errdefs.ErrDataLoss)
	}
	start, err := strconv.ParseUint(f[19], 10, 64)
	if err != nil {
		return Stat{}, fmt.Errorf("process %d: start time %q: %w", pid, f[19], errdefs.ErrDataLoss)
	}
	return Stat{State: f[0][0], StartTime: start}, nil
}
