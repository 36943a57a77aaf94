package shim

import (
	"os/exec"
	"path/filepath"
	"strings"
	"sync"

	specs "github.com/opencontainers/runtime-spec/specs-go"

	"github.com/lazyfork/lazyfork/memfile"
)

// overcommitTarget is the file the overcommit hook covers, in the rootfs.
const overcommitTarget = "proc/sys/vm/overcommit_memory"

// overcommitMountOpts are the hook's mount options: read-only, as RunHook's.
const overcommitMountOpts = "ro,nosuid,nodev,noexec"

// mountBinary is mount(8) on the shim's PATH ("" if there is none).
var mountBinary = sync.OnceValue(func() string {
	p, err := exec.LookPath("mount")
	if err != nil {
		return ""
	}
	return p
})

// overcommitMountHook is the overcommit hook as one mount(8) run:
//
//	mount --bind -o ro,nosuid,nodev,noexec ROOTFS/.lazyfork/mem/FILE ROOTFS/proc/sys/vm/overcommit_memory
//
// A fresh container's start ran this binary as the hook, 6-10 ms of Go
// start-up (the shim links containerd's client); mount(8) takes 1-2 ms. It
// is used only where the spec mounts procfs at /proc (runc mounts it before
// the hook runs, so the target is procfs's file, which is what RunHook
// checks) and mount(8) exists; ok is false otherwise. The paths are the
// rootfs as the hook sees it: runc runs createContainer hooks in the
// container's mount namespace before pivot_root.
func overcommitMountHook(s *specs.Spec, bundle, value string) (specs.Hook, bool) {
	mnt := mountBinary()
	if mnt == "" || s.Root == nil || s.Root.Path == "" || !mountsProc(s) {
		return specs.Hook{}, false
	}
	rootfs := s.Root.Path
	if !filepath.IsAbs(rootfs) {
		rootfs = filepath.Join(bundle, rootfs)
	}
	return specs.Hook{
		Path: mnt,
		Args: []string{"mount", "--bind", "-o", overcommitMountOpts,
			filepath.Join(rootfs, memfile.MountPath, OvercommitFile(value)),
			filepath.Join(rootfs, overcommitTarget)},
	}, true
}

// isOvercommitMountHook tells overcommitMountHook's hooks from others.
func isOvercommitMountHook(h specs.Hook) bool {
	a := h.Args
	return len(a) == 6 && a[0] == "mount" && a[1] == "--bind" &&
		strings.Contains(a[4], memfile.MountPath+"/vm.overcommit_memory.") &&
		strings.HasSuffix(a[5], "/"+overcommitTarget)
}

// mountsProc reports whether the spec mounts procfs at /proc.
func mountsProc(s *specs.Spec) bool {
	for _, m := range s.Mounts {
		if filepath.Clean(m.Destination) == "/proc" && m.Type == "proc" {
			return true
		}
	}
	return false
}
