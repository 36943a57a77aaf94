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
	"sync"

	"github.com/containerd/errdefs"

	"github.com/lazyfork/lazyfork/internal/procfs"
)

// hierarchies caches where the memory hierarchies are mounted: the mount
// table of a host running hundreds of containers takes milliseconds to
// parse, and a move reads its container's limit inside the container's
// pause. A cgroup none of the cached hierarchies holds makes read look at
// the mount table again (a hierarchy mounted since).
var hierarchies struct {
	sync.Mutex
	v1, v2 []string
	read   bool
}

// mountPoints returns the v1 memory hierarchies' and the unified ones' mount
// points, from the mount table when fresh or never read.
func mountPoints(fresh bool) (v1, v2 []string, err error) {
	h := &hierarchies
	h.Lock()
	defer h.Unlock()
	if h.read && !fresh {
		return h.v1, h.v2, nil
	}
	ms, err := procfs.Mounts()
	if err != nil {
		return nil, nil, err
	}
	v1, v2 = nil, nil
	for _, m := range ms {
		switch {
		case m.FSType == "cgroup" && hasOption(m.Super, "memory"):
			v1 = append(v1, m.Point)
		case m.FSType == "cgroup2":
			v2 = append(v2, m.Point)
		}
	}
	h.v1, h.v2, h.read = v1, v2, true
	return v1, v2, nil
}

// dirs returns the directories of cgroup path p that may hold its memory
// files, each with the name of its usage file: the v1 memory hierarchy's
// first, then the unified one's.
func dirs(p string, fresh bool) ([][2]string, error) {
	if p == "" || !strings.HasPrefix(p, "/") || strings.Contains(p, "..") {
		return nil, fmt.Errorf("cgroup path %q is not an absolute cgroupfs path: %w", p, errdefs.ErrInvalidArgument)
	}
	v1, v2, err := mountPoints(fresh)
	if err != nil {
		return nil, err
	}
	var ds [][2]string
	for _, m := range v1 {
		ds = append(ds, [2]string{filepath.Join(m, p), "memory.usage_in_bytes"})
	}
	for _, m := range v2 {
		ds = append(ds, [2]string{filepath.Join(m, p), "memory.current"})
	}
	return ds, nil
}

// read returns the contents of the first of cgroup p's memory files
// name(dir) that exists ("" for none in that hierarchy), and that directory
// with its usage file's name.
func read(p string, name func(d [2]string) string) ([2]string, []byte, error) {
	var tried []string
	for _, fresh := range []bool{false, true} {
		ds, err := dirs(p, fresh)
		if err != nil {
			return [2]string{}, nil, err
		}
		tried = tried[:0]
		for _, d := range ds {
			n := name(d)
			if n == "" {
				continue // not in this hierarchy
			}
			file := filepath.Join(d[0], n)
			tried = append(tried, file)
			if b, err := os.ReadFile(file); err == nil {
				return d, b, nil
			}
		}
	}
	return [2]string{}, nil, fmt.Errorf("cgroup %s (tried %v): %w", p, tried, errdefs.ErrNotFound)
}

// parseBytes parses a memory file's single number.
func parseBytes(file string, b []byte) (int64, error) {
	v, err := strconv.ParseInt(strings.TrimSpace(string(b)), 10, 64)
	if err != nil {
		return 0, fmt.Errorf("%s: %q: %w", file, b, errdefs.ErrDataLoss)
	}
	return v, nil
}

// Usage returns the memory charged to cgroup p, in bytes.
func Usage(p string) (int64, error) {
	d, b, err := read(p, func(d [2]string) string { return d[1] })
	if err != nil {
		return 0, fmt.Errorf("no memory usage: %w", err)
	}
	return parseBytes(filepath.Join(d[0], d[1]), b)
}

// Limit returns cgroup p's memory limit and usage in bytes; ok is false when
// the cgroup has no limit (v1: the "unlimited" page-rounded maximum, v2: "max").
func Limit(p string) (limit, usage int64, ok bool, err error) {
	d, b, err := read(p, func(d [2]string) string {
		if d[1] == "memory.usage_in_bytes" {
			return "memory.limit_in_bytes"
		}
		return "memory.max"
	})
	if err != nil {
		return 0, 0, false, fmt.Errorf("no memory limit: %w", err)
	}
	usageFile := filepath.Join(d[0], d[1])
	u, err := os.ReadFile(usageFile)
	if err != nil {
		return 0, 0, false, err
	}
	if usage, err = parseBytes(usageFile, u); err != nil {
		return 0, 0, false, err
	}
	l, err := strconv.ParseInt(strings.TrimSpace(string(b)), 10, 64)
	if err != nil || l >= 1<<62 { // "max", or v1's unlimited
		return 0, usage, false, nil
	}
	return l, usage, true, nil
}

// KmemV1 returns the kernel memory charged to cgroup p on a v1 memory
// hierarchy (memory.kmem.usage_in_bytes); ok is false where there is none (v2
// counts it in memory.stat: kernel, sock).
func KmemV1(p string) (kmem int64, ok bool) {
	d, b, err := read(p, func(d [2]string) string {
		if d[1] == "memory.usage_in_bytes" {
			return "memory.kmem.usage_in_bytes"
		}
		return ""
	})
	if err != nil {
		return 0, false
	}
	v, err := parseBytes(filepath.Join(d[0], "memory.kmem.usage_in_bytes"), b)
	return v, err == nil
}

// Stat returns cgroup p's memory.stat (bytes and counters by key, e.g.
// "anon" and "shmem" on v2, "rss" and "shmem" on v1).
func Stat(p string) (map[string]int64, error) {
	_, b, err := read(p, func([2]string) string { return "memory.stat" })
	if err != nil {
		return nil, fmt.Errorf("no memory.stat: %w", err)
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
