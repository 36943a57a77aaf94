// Package procfs reads what LazyFork needs from /proc, in one place: a
// process's start time (which tells a live process from a reused PID), its
// state, parent and session, its descendants, its PID in its own namespace,
// its memory (status and smaps_rollup), its cgroups, and the mount table.
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
	// PPID is field 4, Session field 6.
	PPID, Session int
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
	ppid, _ := strconv.Atoi(f[1])
	sid, _ := strconv.Atoi(f[3])
	return Stat{State: f[0][0], PPID: ppid, Session: sid, StartTime: start}, nil
}

// Alive reports whether pid exists and is not a zombie.
func Alive(pid int) bool {
	st, err := ReadStat(pid)
	return err == nil && !st.Zombie()
}

// Cgroup returns process pid's cgroup path for a controller, from
// /proc/PID/cgroup: in the controller's v1 hierarchy (v1 true) if it has one,
// else in the unified hierarchy. No such entry is an error wrapping
// errdefs.ErrNotFound.
func Cgroup(pid int, controller string) (path string, v1 bool, err error) {
	b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/cgroup")
	if err != nil {
		return "", false, fmt.Errorf("cgroup of process %d: %w", pid, errdefs.ErrNotFound)
	}
	unified, found := "", false
	for _, l := range strings.Split(string(b), "\n") {
		f := strings.SplitN(l, ":", 3)
		if len(f) != 3 {
			continue
		}
		for _, c := range strings.Split(f[1], ",") {
			if c == controller {
				return f[2], true, nil
			}
		}
		if f[0] == "0" && f[1] == "" {
			unified, found = f[2], true
		}
	}
	if !found {
		return "", false, fmt.Errorf("process %d has no %s cgroup: %w", pid, controller, errdefs.ErrNotFound)
	}
	return unified, false, nil
}

// Mount is one line of /proc/self/mountinfo.
type Mount struct {
	Point  string // mount point, unescaped
	FSType string
	Super  string // super options, e.g. "rw,memory" for a v1 memory hierarchy
}

// Mounts reads this process's mount table.
func Mounts() ([]Mount, error) {
	b, err := os.ReadFile("/proc/self/mountinfo")
	if err != nil {
		return nil, err
	}
	var out []Mount
	for l := range strings.SplitSeq(string(b), "\n") {
		f := strings.Fields(l)
		sep := -1
		for i, x := range f {
			if x == "-" {
				sep = i
				break
			}
		}
		if len(f) < 5 || sep < 0 || sep+1 >= len(f) {
			continue
		}
		m := Mount{Point: unescapeMount(f[4]), FSType: f[sep+1]}
		if sep+3 < len(f) {
			m.Super = f[sep+3]
		}
		out = append(out, m)
	}
	return out, nil
}

// unescapeMount decodes mountinfo's octal escapes (\040 for a space, ...).
func unescapeMount(s string) string {
	if !strings.Contains(s, `\`) {
		return s
	}
	var b strings.Builder
	for i := 0; i < len(s); i++ {
		if s[i] == '\\' && i+3 < len(s) {
			if n, err := strconv.ParseUint(s[i+1:i+4], 8, 8); err == nil {
				b.WriteByte(byte(n))
				i += 3
				continue
			}
		}
		b.WriteByte(s[i])
	}
	return b.String()
}

// SeccompFilters is the number of seccomp filters process pid runs under
// (Seccomp_filters in its status, Linux 5.9 and later); -1 and an error if
// its status does not say.
func SeccompFilters(pid int) (int, error) {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		return -1, err
	}
	for l := range strings.SplitSeq(string(b), "\n") {
		if v, ok := strings.CutPrefix(l, "Seccomp_filters:"); ok {
			return strconv.Atoi(strings.TrimSpace(v))
		}
	}
	return -1, fmt.Errorf("process %d: no Seccomp_filters in its status (Linux 5.9 or later)", pid)
}
