package harness

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/containerd/containerd/v2/client"
	"github.com/containerd/containerd/v2/core/images"
	"github.com/containerd/containerd/v2/core/snapshots"
	"github.com/containerd/containerd/v2/pkg/namespaces"
	"github.com/containerd/errdefs"
	"golang.org/x/sys/unix"

	"github.com/lazyfork/lazyfork/internal/procfs"
	"github.com/lazyfork/lazyfork/memfile"
)

// removeAll kills and deletes every task, container, image and snapshot in every
// namespace of the private containerd. snapshotters are the snapshotters to sweep
// besides those the containers name.
func removeAll(ctx context.Context, cl *client.Client, snapshotters []string) error {
	nss, err := cl.NamespaceService().List(ctx)
	if err != nil {
		return fmt.Errorf("harness: list namespaces: %w", err)
	}
	var errs []error
	for _, ns := range nss {
		nctx := namespaces.WithNamespace(ctx, ns)
		sns := map[string]bool{"overlayfs": true}
		for _, s := range snapshotters {
			sns[s] = true
		}
		ctrs, err := cl.Containers(nctx)
		if err != nil {
			errs = append(errs, fmt.Errorf("harness: list containers in %s: %w", ns, err))
		}
		for _, ctr := range ctrs {
			if info, err := ctr.Info(nctx, client.WithoutRefreshedMetadata); err == nil && info.Snapshotter != "" {
				sns[info.Snapshotter] = true
			}
			errs = append(errs, deleteContainer(nctx, ctr))
		}
		imgs, err := cl.ImageService().List(nctx)
		if err == nil {
			for i, img := range imgs {
				var opts []images.DeleteOpt
				if i == len(imgs)-1 {
					opts = append(opts, images.SynchronousDelete())
				}
				if err := cl.ImageService().Delete(nctx, img.Name, opts...); err != nil && !errdefs.IsNotFound(err) {
					errs = append(errs, fmt.Errorf("harness: delete image %s: %w", img.Name, err))
				}
			}
		}
		for sn := range sns {
			errs = append(errs, removeSnapshots(nctx, cl.SnapshotService(sn)))
		}
	}
	return errors.Join(errs...)
}

// deleteContainer kills its task (if any) with SIGKILL, deletes it, then deletes
// the container and its snapshot.
func deleteContainer(ctx context.Context, ctr client.Container) error {
	var errs []error
	task, err := ctr.Task(ctx, nil)
	switch {
	case err == nil:
		kctx, cancel := context.WithTimeout(ctx, 20*time.Second)
		if _, err := task.Delete(kctx, client.WithProcessKill); err != nil && !errdefs.IsNotFound(err) {
			// A task that never started (failed restore: CREATED, pid 0) may refuse
			// the wait; a plain kill plus a forced delete clears it.
			_ = task.Kill(kctx, syscall.SIGKILL, client.WithKillAll)
			if _, err2 := task.Delete(kctx, client.WithProcessKill); err2 != nil && !errdefs.IsNotFound(err2) {
				errs = append(errs, fmt.Errorf("harness: delete task %s: %w", ctr.ID(), err2))
			}
		}
		cancel()
	case !errdefs.IsNotFound(err):
		errs = append(errs, fmt.Errorf("harness: task of %s: %w", ctr.ID(), err))
	}
	if err := ctr.Delete(ctx, client.WithSnapshotCleanup); err != nil && !errdefs.IsNotFound(err) {
		// The snapshot may already be gone (e.g. removed by the test).
		if err2 := ctr.Delete(ctx); err2 != nil && !errdefs.IsNotFound(err2) {
			errs = append(errs, fmt.Errorf("harness: delete container %s: %w", ctr.ID(), err))
		}
	}
	return errors.Join(errs...)
}

// removeSnapshots removes every snapshot, children before parents.
func removeSnapshots(ctx context.Context, sn snapshots.Snapshotter) error {
	for pass := 0; pass < 64; pass++ {
		var keys []string
		if err := sn.Walk(ctx, func(_ context.Context, info snapshots.Info) error {
			keys = append(keys, info.Name)
			return nil
		}); err != nil {
			if errdefs.IsNotFound(err) || errdefs.IsNotImplemented(err) {
				return nil
			}
			return fmt.Errorf("harness: walk snapshots: %w", err)
		}
		if len(keys) == 0 {
			return nil
		}
		removed := 0
		for _, k := range keys {
			if err := sn.Remove(ctx, k); err == nil {
				removed++
			}
		}
		if removed == 0 {
			return fmt.Errorf("harness: %d snapshots cannot be removed (e.g. %s): %w", len(keys), keys[0], errdefs.ErrFailedPrecondition)
		}
	}
	return nil
}

// ShimPIDs returns the PIDs of shim processes serving the containerd at address
// (any process whose argv holds `-address <address>`).
func ShimPIDs(address string) []int {
	return pidsWithArgs("-address", address)
}

// pidsWithArgs returns the processes whose argv holds flag immediately followed
// by value.
func pidsWithArgs(flag, value string) []int {
	var pids []int
	for _, p := range procfs.Find(func(args []string) bool { return procfs.HasArg(args, value, flag) }) {
		pids = append(pids, p.PID)
	}
	return pids
}

func killShims(address string) error {
	pids := ShimPIDs(address)
	for _, pid := range pids {
		_ = syscall.Kill(pid, syscall.SIGKILL)
	}
	for _, pid := range pids {
		if !waitGone(pid, 10*time.Second) {
			return fmt.Errorf("harness: shim pid %d does not die", pid)
		}
	}
	return nil
}

// waitGone waits until pid no longer exists or is a zombie.
func waitGone(pid int, timeout time.Duration) bool {
	deadline := time.Now().Add(timeout)
	for {
		if !procfs.Alive(pid) {
			return true
		}
		if time.Now().After(deadline) {
			return false
		}
		time.Sleep(10 * time.Millisecond)
	}
}

type mountEntry struct {
	point  string
	fstype string
	super  string // super options, e.g. "rw,memory" for a v1 memory hierarchy
}

func readMounts() ([]mountEntry, error) {
	ms, err := procfs.Mounts()
	if err != nil {
		return nil, err
	}
	out := make([]mountEntry, len(ms))
	for i, m := range ms {
		out[i] = mountEntry{point: m.Point, fstype: m.FSType, super: m.Super}
	}
	return out, nil
}

// MountsUnder lists mount points at or below dir, deepest first.
func MountsUnder(dir string) ([]string, error) {
	ms, err := readMounts()
	if err != nil {
		return nil, err
	}
	dir = filepath.Clean(dir)
	var pts []string
	for _, m := range ms {
		if m.point == dir || strings.HasPrefix(m.point, dir+"/") {
			pts = append(pts, m.point)
		}
	}
	sort.SliceStable(pts, func(i, j int) bool { return len(pts[i]) > len(pts[j]) })
	return pts, nil
}

func unmountUnder(dir string) error {
	for pass := 0; pass < 5; pass++ {
		pts, err := MountsUnder(dir)
		if err != nil {
			return fmt.Errorf("harness: read mounts: %w", err)
		}
		if len(pts) == 0 {
			return nil
		}
		for _, p := range pts {
			_ = unix.Unmount(p, unix.MNT_DETACH)
		}
	}
	pts, _ := MountsUnder(dir)
	if len(pts) > 0 {
		return fmt.Errorf("harness: mounts left under %s: %v", dir, pts)
	}
	return nil
}

// RemoveLazyForkRoot tears down a LazyFork root (a test's LAZYFORK_ROOT):
// it detaches every mount under it (the tmpfs the shims mounted goes once
// nothing maps its files) and removes the directory. Memory files are
// immutable (memfile.Seal); where the root was on a tmpfs already (no mount
// of its own, e.g. a /tmp on tmpfs), they are unsealed to be removed.
// Call it after the containers are gone.
func RemoveLazyForkRoot(root string) error {
	if err := unmountUnder(root); err != nil {
		return err
	}
	if err := memfile.RemoveAll(root); err != nil {
		return fmt.Errorf("harness: remove LazyFork root %s: %w", root, err)
	}
	return nil
}

// CgroupDirs returns, for every mounted cgroup hierarchy (v1 controllers and
// cgroup2), the directory of cgroup path p (as in linux.cgroupsPath) if it exists.
func CgroupDirs(p string) []string {
	ms, err := readMounts()
	if err != nil {
		return nil
	}
	var dirs []string
	for _, m := range ms {
		if m.fstype != "cgroup" && m.fstype != "cgroup2" {
			continue
		}
		d := filepath.Join(m.point, p)
		if st, err := os.Stat(d); err == nil && st.IsDir() {
			dirs = append(dirs, d)
		}
	}
	return dirs
}

// removeCgroups kills any process left in cgroup parent p (all hierarchies),
// thaws frozen cgroups, and removes the cgroup directories, deepest first.
func removeCgroups(p string) error {
	var errs []error
	for _, root := range CgroupDirs(p) {
		var dirs []string
		_ = filepath.WalkDir(root, func(path string, d os.DirEntry, err error) error {
			if err == nil && d.IsDir() {
				dirs = append(dirs, path)
			}
			return nil
		})
		sort.SliceStable(dirs, func(i, j int) bool { return len(dirs[i]) > len(dirs[j]) })
		for _, d := range dirs {
			if err := removeCgroup(d); err != nil {
				errs = append(errs, err)
			}
		}
	}
	return errors.Join(errs...)
}

func removeCgroup(d string) error {
	deadline := time.Now().Add(10 * time.Second)
	for {
		// Killed processes of a frozen cgroup never exit: thaw first.
		_ = os.WriteFile(filepath.Join(d, "freezer.state"), []byte("THAWED"), 0)
		_ = os.WriteFile(filepath.Join(d, "cgroup.freeze"), []byte("0"), 0)
		if b, err := os.ReadFile(filepath.Join(d, "cgroup.procs")); err == nil {
			for _, f := range strings.Fields(string(b)) {
				if pid, err := strconv.Atoi(f); err == nil && pid > 1 {
					_ = syscall.Kill(pid, syscall.SIGKILL)
				}
			}
		}
		err := syscall.Rmdir(d)
		if err == nil || errors.Is(err, syscall.ENOENT) {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("harness: remove cgroup %s: %w", d, err)
		}
		time.Sleep(20 * time.Millisecond)
	}
}
