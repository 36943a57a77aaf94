package shim

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"

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
func unmountRestoreLeftovers(ctx context.Context, ns, id string) (clean bool) {
	ms, err := procfs.Mounts()
	if err != nil {
		return false
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
	clean = true
	for _, m := range found {
		if err := unix.Unmount(m, unix.MNT_DETACH); err != nil && !errors.Is(err, unix.EINVAL) && !errors.Is(err, unix.ENOENT) {
			log.G(ctx).WithError(err).WithField("mount", m).Warn("lazyfork: unmount what a killed restore left")
			clean = false
			continue
		}
		_ = os.Remove(m)
	}
	return clean
}

// removeCgroup removes the (empty) cgroup directories of a cgroupfs-style
// cgroupsPath in every hierarchy. runc removes them itself when it deletes a
// container it knows; after a failed restore runc knows no container, and the
// directories CRIU or runc made would stay behind. Busy or missing directories
// are left alone; clean is false if one stays busy (processes in it), which
// a later try may remove. Hierarchies the shim may not write do not count.
func removeCgroup(ctx context.Context, cgroupsPath string) (clean bool) {
	clean = true
	for _, d := range cgroupDirs(cgroupsPath) {
		if err := unix.Rmdir(d); err != nil && !errors.Is(err, unix.ENOENT) {
			log.G(ctx).WithError(err).WithField("cgroup", d).Debug("lazyfork: leave cgroup")
			if errors.Is(err, unix.EBUSY) || errors.Is(err, unix.ENOTEMPTY) {
				clean = false
			}
		}
	}
	return clean
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
	m, err := cgroupV1Mounts()
	if err != nil {
		return nil, err
	}
	return cgroup1.Load(m.pidPath(pid), cgroup1.WithHierarchy(m.hierarchy))
}

// v1Mounts is what cgroup1.PidPath and cgroup1.Load read from
// /proc/self/mountinfo, read once per shim: they parse it again for every
// controller on every call, and the shim's mountinfo grows with every
// container's mounts, so a batch of forks paid for it quadratically (15% of
// a group shim's CPU in a batch of 100). The cgroup mounts themselves do not
// change while the shim runs.
type v1Mounts struct {
	subsystems []cgroup1.Subsystem
	dest       map[string]string // controller (or name=X) -> its mount's root, as cgroup1's getCgroupDestination
}

// cgroupV1Mounts returns the v1 mounts, read on the first call that succeeds.
func cgroupV1Mounts() (*v1Mounts, error) {
	v1MountsMu.Lock()
	defer v1MountsMu.Unlock()
	if v1MountsRead != nil {
		return v1MountsRead, nil
	}
	m, err := readV1Mounts()
	if err != nil {
		return nil, err
	}
	v1MountsRead = m
	return m, nil
}

var (
	v1MountsMu   sync.Mutex
	v1MountsRead *v1Mounts
)

func readV1Mounts() (*v1Mounts, error) {
	subs, err := cgroup1.Default()
	if err != nil {
		return nil, err
	}
	m := &v1Mounts{subsystems: subs, dest: map[string]string{}}
	b, err := os.ReadFile("/proc/self/mountinfo")
	if err != nil {
		return nil, err
	}
	for line := range strings.SplitSeq(string(b), "\n") {
		fields := strings.Split(line, " ")
		if len(fields) < 10 || fields[len(fields)-3] != "cgroup" {
			continue
		}
		for opt := range strings.SplitSeq(fields[len(fields)-1], ",") {
			if _, seen := m.dest[opt]; !seen {
				m.dest[opt] = fields[3]
			}
		}
	}
	return m, nil
}

func (m *v1Mounts) hierarchy() ([]cgroup1.Subsystem, error) { return m.subsystems, nil }

// pidPath is cgroup1.PidPath(pid) with the mount roots read once.
func (m *v1Mounts) pidPath(pid int) cgroup1.Path {
	p := fmt.Sprintf("/proc/%d/cgroup", pid)
	paths, err := cgroup1.ParseCgroupFile(p)
	if err != nil {
		return func(cgroup1.Name) (string, error) { return "", fmt.Errorf("parse cgroup file %s: %w", p, err) }
	}
	for n, cg := range paths {
		dest, ok := m.dest[n]
		if !ok {
			return func(cgroup1.Name) (string, error) { return "", cgroup1.ErrNoCgroupMountDestination }
		}
		rel, err := filepath.Rel(dest, cg)
		if err != nil {
			return func(cgroup1.Name) (string, error) { return "", err }
		}
		if rel == "." {
			rel = dest
		}
		paths[n] = filepath.Join("/", rel)
	}
	return func(name cgroup1.Name) (string, error) {
		root, ok := paths[string(name)]
		if !ok {
			if root, ok = paths["name="+string(name)]; !ok {
				return "", cgroup1.ErrControllerNotActive
			}
		}
		return root, nil
	}
}

// cgroupWarmEnv turns warmCgroupAttach off ("off").
const cgroupWarmEnv = "LAZYFORK_CGROUP_WARM"

// warming is set while a warmCgroupAttach write is under way.
var warming atomic.Bool

// warmForMove is warmCgroupAttach before a move: on cgroup v1, where the
// move's helper joins the container's memory cgroup (on v2 it stays out of
// the frozen cgroup, rehome.go).
func warmForMove(ctx context.Context) {
	if cgroups.Mode() != cgroups.Unified {
		warmCgroupAttach(ctx)
	}
}

// warmCgroupAttach starts, in the background, a write of the shim's own pid
// to its own cgroup.procs: a migration that moves nothing. Unless cgroups
// are mounted with favordynmods, every write to a cgroup.procs first waits
// for an RCU grace period (cgroup_threadgroup_rwsem's rcu_sync: 5-13 ms on
// these hosts), unless another writer went through one within about a grace
// period before. So runc's first such write (CRIU into a fork's cgroups, the
// init of a new container, an exec'd process) and a move's helper joining
// the task's memory cgroup find the grace period under way or passed,
// instead of waiting for a whole one, while their own start-up runs. One
// write at a time: a later caller shares the one under way.
func warmCgroupAttach(ctx context.Context) {
	if os.Getenv(cgroupWarmEnv) == "off" || !warming.CompareAndSwap(false, true) {
		return
	}
	go func() {
		defer warming.Store(false)
		if err := rewriteOwnCgroup(); err != nil {
			log.G(ctx).WithError(err).Debug("lazyfork: warm cgroup attach")
		}
	}()
}

// rewriteOwnCgroup writes this process's pid to the cgroup.procs of its own
// pids (or memory) cgroup: a migration to where it is.
func rewriteOwnCgroup() error {
	self := os.Getpid()
	var errs []error
	for _, controller := range []string{"pids", "memory"} {
		dir, err := cgroupDir(self, controller)
		if err == nil && strings.Contains(dir, "..") {
			// A cgroup namespace's view of a cgroup outside it: not ours
			// to write.
			err = fmt.Errorf("cgroup %s is outside this process's cgroup namespace", dir)
		}
		if err != nil {
			errs = append(errs, err)
			continue
		}
		// Never O_CREAT: on a hybrid host a unified path read as a v1 one
		// names no cgroup file.
		f, err := os.OpenFile(filepath.Join(dir, "cgroup.procs"), os.O_WRONLY, 0)
		if err != nil {
			errs = append(errs, err)
			continue
		}
		_, err = f.WriteString(strconv.Itoa(self))
		return errors.Join(err, f.Close())
	}
	return errors.Join(errs...)
}
