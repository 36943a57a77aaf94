package shim

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"

	"github.com/containerd/cgroups/v3"
	"github.com/containerd/cgroups/v3/cgroup1"
	cgroupsv2 "github.com/containerd/cgroups/v3/cgroup2"
	"github.com/containerd/log"
	"golang.org/x/sys/unix"

	"github.com/lazyfork/lazyfork/internal/procfs"
)

const cgroupRoot = "/sys/fs/cgroup"

// cgroupDirs are the directories of a cgroupfs-style cgroupsPath in every
// hierarchy (nil for systemd-style or relative paths, which belong to runc).
func cgroupDirs(cgroupsPath string) []string {
	if !strings.HasPrefix(cgroupsPath, "/") || strings.Contains(cgroupsPath, "..") {
		return nil
	}
	if cgroups.Mode() == cgroups.Unified {
		return []string{filepath.Join(cgroupRoot, cgroupsPath)}
	}
	ents, err := os.ReadDir(cgroupRoot)
	if err != nil {
		return nil
	}
	var dirs []string
	for _, e := range ents {
		if !e.IsDir() || e.Name() == "unified" {
			continue
		}
		dirs = append(dirs, filepath.Join(cgroupRoot, e.Name(), cgroupsPath))
	}
	return dirs
}

// killCgroup sends SIGKILL to every process in a cgroupfs-style cgroupsPath
// (a restore that never finished: CRIU, its restorer, the half-made tree).
// It reports how many it signalled.
func killCgroup(cgroupsPath string) int {
	seen := map[int]bool{}
	for _, d := range cgroupDirs(cgroupsPath) {
		b, err := os.ReadFile(filepath.Join(d, "cgroup.procs"))
		if err != nil {
			continue
		}
		for _, f := range strings.Fields(string(b)) {
			var pid int
			if _, err := fmt.Sscan(f, &pid); err != nil || pid <= 1 || seen[pid] {
				continue
			}
			seen[pid] = true
			_ = unix.Kill(pid, unix.SIGKILL)
		}
	}
	return len(seen)
}

// unmountRestoreLeftovers unmounts what a restore killed midway (a restore
// timeout, a shim or runc killed) left mounted: CRIU's cgroup yard
// (.criu.cgyard.*, one mount per hierarchy) in the task's work directory,
// which containerd would then try to delete file by file, and runc's
// criu-root bind of the rootfs in its state directory <root>/<ns>/<id>.
// CRIU and runc remove both themselves when they end normally.
func unmountRestoreLeftovers(ctx context.Context, ns, id string) {
	ms, err := procfs.Mounts()
	if err != nil {
		return
	}
	// The work directory is the bundle's, named after the id; containerd
	// renames a bundle it deletes to ".<id>" first.
	yards := []string{"/" + id + "/.criu.cgyard.", "/." + id + "/.criu.cgyard."}
	criuRoot := "/" + ns + "/" + id + "/criu-root"
	var found []string
	for _, mnt := range ms {
		if m := mnt.Point; strings.Contains(m, yards[0]) || strings.Contains(m, yards[1]) || strings.HasSuffix(m, criuRoot) {
			found = append(found, m)
		}
	}
	// Deepest first: a yard's hierarchies, then the yard itself.
	slices.SortFunc(found, func(a, b string) int { return len(b) - len(a) })
	for _, m := range found {
		if err := unix.Unmount(m, unix.MNT_DETACH); err != nil && !errors.Is(err, unix.EINVAL) && !errors.Is(err, unix.ENOENT) {
			log.G(ctx).WithError(err).WithField("mount", m).Warn("lazyfork: unmount what a killed restore left")
			continue
		}
		_ = os.Remove(m)
	}
}

// removeCgroup removes the (empty) cgroup directories of a cgroupfs-style
// cgroupsPath in every hierarchy. runc removes them itself when it deletes a
// container it knows; after a failed restore runc knows no container, and the
// directories CRIU or runc made would stay behind. Busy or missing directories
// are left alone.
func removeCgroup(ctx context.Context, cgroupsPath string) {
	for _, d := range cgroupDirs(cgroupsPath) {
		if err := unix.Rmdir(d); err != nil && !errors.Is(err, unix.ENOENT) {
			log.G(ctx).WithError(err).WithField("cgroup", d).Debug("lazyfork: leave cgroup")
		}
	}
}

// loadCgroup loads the cgroup a process lives in, the way runc's shim does for
// the tasks it creates (it does not for restored ones).
func loadCgroup(pid int) (any, error) {
	if pid <= 0 {
		return nil, fmt.Errorf("no process")
	}
	if cgroups.Mode() == cgroups.Unified {
		g, err := cgroupsv2.PidGroupPath(pid)
		if err != nil {
			return nil, err
		}
		return cgroupsv2.Load(g)
	}
	return cgroup1.Load(cgroup1.PidPath(pid))
}
