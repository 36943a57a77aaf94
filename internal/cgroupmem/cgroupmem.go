// Package cgroupmem reads a memory cgroup's figures, cgroup v1 or v2, in one
// place: its usage (v1 memory.usage_in_bytes, v2 memory.current) and its
// memory.stat. A cgroup is named by its path in the hierarchy, as in an OCI
// spec's linux.cgroupsPath or /proc/PID/cgroup; the hierarchies are found in
// the mount table, so a v1 memory controller mounted anywhere is found.
package cgroupmem

import (
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"

	"github.com/containerd/errdefs"

	"github.com/lazyfork/lazyfork/internal/procfs"
)

// dirs returns the directories of cgroup path p that may hold its memory
// files, each with the name of its usage file: the v1 memory hierarchy's
// first, then the unified one's.
func dirs(p string) ([][2]string, error) {
	if p == "" || !strings.HasPrefix(p, "/") || strings.Contains(p, "..") {
		return nil, fmt.Errorf("cgroup path %q is not an absolute cgroupfs path: %w", p, errdefs.ErrInvalidArgument)
	}
	ms, err := procfs.Mounts()
	if err != nil {
		return nil, err
	}
	var v1, v2 [][2]string
	for _, m := range ms {
		switch {
		case m.FSType == "cgroup" && hasOption(m.Super, "memory"):
			v1 = append(v1, [2]string{filepath.Join(m.Point, p), "memory.usage_in_bytes"})
		case m.FSType == "cgroup2":
			v2 = append(v2, [2]string{filepath.Join(m.Point, p), "memory.current"})
		}
	}
	return append(v1, v2...), nil
}

// Usage returns the memory charged to cgroup p, in bytes.
func Usage(p string) (int64, error) {
	ds, err := dirs(p)
	if err != nil {
		return 0, err
	}
	var tried []string
	for _, d := range ds {
		file := filepath.Join(d[0], d[1])
		tried = append(tried, file)
		b, err := os.ReadFile(file)
		if err != nil {
			continue
		}
		v, err := strconv.ParseInt(strings.TrimSpace(string(b)), 10, 64)
		if err != nil {
			return 0, fmt.Errorf("%s: %q: %w", file, b, errdefs.ErrDataLoss)
		}
		return v, nil
	}
	return 0, fmt.Errorf("no memory usage for cgroup %s (tried %v): %w", p, tried, errdefs.ErrNotFound)
}

// Limit returns cgroup p's memory limit and usage in bytes; ok is false when
// the cgroup has no limit (v1: the "unlimited" page-rounded maximum, v2: "max").
func Limit(p string) (limit, usage int64, ok bool, err error) {
	ds, err := dirs(p)
	if err != nil {
		return 0, 0, false, err
	}
	for _, d := range ds {
		limitFile := "memory.max"
		if d[1] == "memory.usage_in_bytes" {
			limitFile = "memory.limit_in_bytes"
		}
		b, err := os.ReadFile(filepath.Join(d[0], limitFile))
		if err != nil {
			continue
		}
		if usage, err = Usage(p); err != nil {
			return 0, 0, false, err
		}
		l, err := strconv.ParseInt(strings.TrimSpace(string(b)), 10, 64)
		if err != nil || l >= 1<<62 { // "max", or v1's unlimited
			return 0, usage, false, nil
		}
		return l, usage, true, nil
	}
	return 0, 0, false, fmt.Errorf("no memory limit for cgroup %s: %w", p, errdefs.ErrNotFound)
}

// Stat returns cgroup p's memory.stat (bytes and counters by key, e.g.
// "anon" and "shmem" on v2, "rss" and "shmem" on v1).
func Stat(p string) (map[string]int64, error) {
	ds, err := dirs(p)
	if err != nil {
		return nil, err
	}
	for _, d := range ds {
		b, err := os.ReadFile(filepath.Join(d[0], "memory.stat"))
		if err != nil {
			continue
		}
		out := map[string]int64{}
		for _, l := range strings.Split(string(b), "\n") {
			k, v, ok := strings.Cut(l, " ")
			if !ok {
				continue
			}
			if n, err := strconv.ParseInt(strings.TrimSpace(v), 10, 64); err == nil {
				out[k] = n
			}
		}
		return out, nil
	}
	return nil, fmt.Errorf("no memory.stat for cgroup %s: %w", p, errdefs.ErrNotFound)
}

// hasOption reports whether comma-separated opts holds opt (a v1 hierarchy's
// super options name its controllers).
func hasOption(opts, opt string) bool {
	for _, c := range strings.Split(opts, ",") {
		if c == opt {
			return true
		}
	}
	return false
}
