package shim

import (
	"encoding/json"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"

	specs "github.com/opencontainers/runtime-spec/specs-go"
	"golang.org/x/sys/unix"

	"github.com/lazyfork/lazyfork/memfile"
	"github.com/lazyfork/lazyfork/memfile/rehome/movehelper"
)

// RunHook runs the shim binary as an OCI hook: args are os.Args[2:] after
// HookArg. It returns the process exit code. The one hook is
//
//	overcommit FILE   (createContainer) bind-mount /.lazyfork/mem/FILE read-only
//	                  over /proc/sys/vm/overcommit_memory
//
// runc runs createContainer hooks in the container's mount namespace after the
// spec's mounts and before pivot_root, with the container state on stdin.
//
//	kerndat           (for the shim, in a new mount namespace) write CRIU's
//	                  kernel-feature cache on stdout (see ensureKerndatCache)
//
//	hwbreak           (for the shim) probe whether the host's hardware
//	                  breakpoints trap: "ok" or "broken" on stdout
//
//	rehome            (for the shim) move a frozen container onto a memory
//	                  file: a JSON request on stdin, the reply on stdout
func RunHook(args []string) int {
	if len(args) == 1 && args[0] == kerndatHelperArg {
		if err := runKerndatHelper(); err != nil {
			fmt.Fprintf(os.Stderr, "lazyfork kerndat: %v\n", err)
			return 1
		}
		return 0
	}
	if len(args) == 1 && args[0] == hwbreakHelperArg {
		if err := runHwbreakHelper(); err != nil {
			fmt.Fprintf(os.Stderr, "lazyfork hwbreak: %v\n", err)
			return 1
		}
		return 0
	}
	if len(args) == 1 && args[0] == "rehome" {
		if err := movehelper.Run(os.Stdin, os.Stdout); err != nil {
			fmt.Fprintf(os.Stderr, "lazyfork rehome: %v\n", err)
			return 1
		}
		return 0
	}
	if err := runHook(args, os.Stdin); err != nil {
		fmt.Fprintf(os.Stderr, "lazyfork hook: %v\n", err)
		return 1
	}
	return 0
}

func runHook(args []string, stdin io.Reader) error {
	if len(args) != 2 || args[0] != "overcommit" {
		return fmt.Errorf("usage: %s overcommit FILE", HookArg)
	}
	file := args[1]
	if file != filepath.Base(file) || !strings.HasPrefix(file, "vm.overcommit_memory.") {
		return fmt.Errorf("bad overcommit file name %q", file)
	}
	var st specs.State
	if err := json.NewDecoder(stdin).Decode(&st); err != nil {
		return fmt.Errorf("decode container state: %w", err)
	}
	if st.Bundle == "" {
		return fmt.Errorf("container state has no bundle")
	}
	s, err := readSpec(st.Bundle)
	if err != nil {
		return err
	}
	if s.Root == nil || s.Root.Path == "" {
		return fmt.Errorf("spec has no root")
	}
	rootfs := s.Root.Path
	if !filepath.IsAbs(rootfs) {
		rootfs = filepath.Join(st.Bundle, rootfs)
	}
	src := filepath.Join(rootfs, memfile.MountPath, file)
	dst := filepath.Join(rootfs, "proc/sys/vm/overcommit_memory")
	var fs unix.Statfs_t
	if err := unix.Statfs(filepath.Dir(dst), &fs); err != nil {
		return fmt.Errorf("statfs %s: %w", filepath.Dir(dst), err)
	}
	if fs.Type != unix.PROC_SUPER_MAGIC {
		return fmt.Errorf("%s is not on procfs", dst)
	}
	if err := unix.Mount(src, dst, "", unix.MS_BIND, ""); err != nil {
		return fmt.Errorf("bind %s on %s: %w", src, dst, err)
	}
	flags := uintptr(unix.MS_BIND | unix.MS_REMOUNT | unix.MS_RDONLY | unix.MS_NOSUID | unix.MS_NODEV | unix.MS_NOEXEC)
	if err := unix.Mount("", dst, "", flags, ""); err != nil {
		return fmt.Errorf("remount %s read-only: %w", dst, err)
	}
	return nil
}
