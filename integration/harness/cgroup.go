package harness

import (
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"

	"github.com/containerd/errdefs"
)

// MemoryUsage returns the memory charged to cgroup path p (as in
// linux.cgroupsPath): memory.usage_in_bytes of the v1 memory controller, or
// memory.current on cgroup v2.
func MemoryUsage(p string) (int64, error) {
	ms, err := readMounts()
	if err != nil {
		return 0, err
	}
	var tried []string
	for _, m := range ms {
		var file string
		switch {
		case m.fstype == "cgroup" && hasOption(m.super, "memory"):
			file = filepath.Join(m.point, p, "memory.usage_in_bytes")
		case m.fstype == "cgroup2":
			file = filepath.Join(m.point, p, "memory.current")
		default:
			continue
		}
		tried = append(tried, file)
		b, err := os.ReadFile(file)
		if err != nil {
			continue
		}
		return strconv.ParseInt(strings.TrimSpace(string(b)), 10, 64)
	}
	return 0, fmt.Errorf("harness: no memory usage for cgroup %s (tried %v): %w", p, tried, errdefs.ErrNotFound)
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
