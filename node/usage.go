//go:build linux

package node

import (
	"context"
	"fmt"
	"io"
	"os"
	"strconv"
	"strings"

	"github.com/containerd/errdefs"

	"github.com/lazyfork/lazyfork/internal/cgroupmem"
	"github.com/lazyfork/lazyfork/internal/procfs"
	"github.com/lazyfork/lazyfork/memfile"
)

// Usage reads the memory of process pid (/proc/PID/maps and status) and
// of a cgroup (v1 memory controller or v2); what it cannot read is 0.
func (l *Local) Usage(_ context.Context, pid uint32, cgroup string) (Usage, error) {
	u := Usage{Memory: cgroupMemory(cgroup)}
	if pid == 0 {
		return u, nil
	}
	if m, err := procMemFiles(pid); err == nil {
		u.MemFileBytes, u.MemFileMappings = m.bytes, m.mappings
	}
	u.RssAnon, u.RssShared = procRss(pid)
	return u, nil
}

// memFileUse is what a process maps of LazyFork's memory files.
type memFileUse struct {
	bytes    int64 // the mappings' sizes (address space, not resident pages)
	mappings int
}

// procMemFiles reads /proc/PID/maps of a container's process (one read): the
// memory files appear at memfile.MountPath, where the container sees them.
func procMemFiles(pid uint32) (memFileUse, error) {
	if pid == 0 {
		return memFileUse{}, fmt.Errorf("no process: %w", errdefs.ErrNotFound)
	}
	f, err := os.Open(fmt.Sprintf("/proc/%d/maps", pid))
	if err != nil {
		return memFileUse{}, err
	}
	defer f.Close()
	return parseMemFileMaps(f)
}

// parseMemFileMaps sums the mappings of a /proc/PID/maps text whose path lies
// under memfile.MountPath ("start-end perms offset dev inode path", the path
// possibly followed by " (deleted)").
func parseMemFileMaps(r io.Reader) (memFileUse, error) {
	var u memFileUse
	b, err := io.ReadAll(r)
	if err != nil {
		return u, err
	}
	prefix := memfile.MountPath + "/"
	for _, l := range strings.Split(string(b), "\n") {
		f := strings.Fields(l)
		if len(f) < 6 || !strings.HasPrefix(f[5], prefix) {
			continue
		}
		lo, hi, ok := strings.Cut(f[0], "-")
		if !ok {
			continue
		}
		start, err1 := strconv.ParseUint(lo, 16, 64)
		end, err2 := strconv.ParseUint(hi, 16, 64)
		if err1 != nil || err2 != nil || end < start {
			continue
		}
		u.bytes += int64(end - start)
		u.mappings++
	}
	return u, nil
}

// procRss reads RssAnon and RssShmem (pages of the memory files) of a process.
func procRss(pid uint32) (anon, shared int64) {
	m, _ := procfs.ReadMem(int(pid)) // the status fields, even if smaps_rollup is not readable
	return m.RssAnon, m.RssShmem
}

// cgroupMemory reads a cgroup's memory usage: cgroup v1 (memory controller)
// or v2; 0 if unknown (e.g. a systemd slice path).
func cgroupMemory(path string) int64 {
	v, _ := cgroupmem.Usage(path)
	return v
}
