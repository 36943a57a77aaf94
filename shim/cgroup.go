package shim

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"

	"github.com/containerd/cgroups/v3"
	"github.com/containerd/cgroups/v3/cgroup1"
	cgroupsv2 "github.com/containerd/cgroups/v3/cgroup2"
	"github.com/containerd/log"
	"golang.org/x/sys/unix"
)

const cgroupRoot = "/sys/fs/cgroup"

// removeCgroup removes the (empty) cgroup directories of a cgroupfs-style
// cgroupsPath in every hierarchy. runc removes them itself when it deletes a
// container it knows; after a failed restore runc knows no container, and the
// directories CRIU or runc made would stay behind. Busy or missing directories
// are left alone.
func removeCgroup(ctx context.Context, cgroupsPath string) {
	if !strings.HasPrefix(cgroupsPath, "/") || strings.Contains(cgroupsPath, "..") {
		return // systemd-style or relative paths belong to runc alone
	}
	var dirs []string
	if cgroups.Mode() == cgroups.Unified {
		dirs = []string{filepath.Join(cgroupRoot, cgroupsPath)}
	} else {
		ents, err := os.ReadDir(cgroupRoot)
		if err != nil {
			return
		}
		for _, e := range ents {
			if !e.IsDir() || e.Name() == "unified" {
				continue
			}
			dirs = append(dirs, filepath.Join(cgroupRoot, e.Name(), cgroupsPath))
		}
	}
	for _, d := range dirs {
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
