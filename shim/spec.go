package shim

import (
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"

	"github.com/containerd/errdefs"
	specs "github.com/opencontainers/runtime-spec/specs-go"

	"github.com/lazyfork/lazyfork/internal/atomicfile"
	"github.com/lazyfork/lazyfork/memfile"
)

const specFile = "config.json"

// HookArg is the first argument that makes the shim binary act as LazyFork's
// OCI hook instead of a shim (see RunHook).
const HookArg = "lazyfork-hook"

// OvercommitFile is the file, inside a family's memory directory, that is
// bind-mounted over /proc/sys/vm/overcommit_memory. It lives there so that
// CRIU sees the mount as a bind of the external /.lazyfork/mem mount and
// restores it without help.
func OvercommitFile(value string) string { return "vm.overcommit_memory." + value }

func readSpec(bundle string) (*specs.Spec, error) {
	b, err := os.ReadFile(filepath.Join(bundle, specFile))
	if err != nil {
		return nil, fmt.Errorf("read bundle spec: %w", err)
	}
	var s specs.Spec
	if err := json.Unmarshal(b, &s); err != nil {
		return nil, fmt.Errorf("decode bundle spec: %v: %w", err, errdefs.ErrInvalidArgument)
	}
	return &s, nil
}

// specFileMode is the mode of a bundle's config.json when there is none to
// keep: what containerd writes (0666 less the usual umask).
const specFileMode os.FileMode = 0o644

// writeSpec replaces the bundle's config.json atomically: runc must never read
// half of it. The new file keeps the mode of the one it replaces (containerd's),
// and is readable by the container's mapped root when the spec has a user
// namespace: LazyFork's createContainer hook runs as that user and reads it
// (containerd gives the bundle directory the same group, mode 0710).
func writeSpec(bundle string, s *specs.Spec) error {
	b, err := json.Marshal(s)
	if err != nil {
		return err
	}
	path := filepath.Join(bundle, specFile)
	mode := specFileMode
	if fi, err := os.Stat(path); err == nil {
		mode = fi.Mode().Perm()
	}
	gid, mapped := mappedRootGID(s)
	if mapped {
		mode |= 0o040
	}
	if err := writeFileAtomic(path, b, mode); err != nil {
		return err
	}
	if mapped {
		if err := os.Chown(path, -1, int(gid)); err != nil {
			return fmt.Errorf("bundle spec: give %s to the container's root group %d (user namespace): %w", path, gid, err)
		}
	}
	return nil
}

// mappedRootGID is the host GID of the container's root group when the spec
// maps IDs (a user namespace), as containerd reads it for the bundle directory.
func mappedRootGID(s *specs.Spec) (uint32, bool) {
	if s.Linux == nil {
		return 0, false
	}
	for _, m := range s.Linux.GIDMappings {
		if m.ContainerID == 0 && m.HostID != 0 {
			return m.HostID, true
		}
	}
	return 0, false
}

// writeFileAtomic replaces path with data by a rename: a reader sees the old
// file or the new one, never a torn write. Without fsync: the shim writes only
// into bundles (containerd's runtime state, meaningless after the boot) and
// LazyFork's tmpfs, where a sync protects nothing but costs a disk flush per
// file where the bundles are on a disk (6-11 ms each on a loaded host; a fork
// wrote three: its spec at shim start and at create, and its state).
func writeFileAtomic(path string, data []byte, mode os.FileMode) error {
	return atomicfile.WriteVolatile(path, data, mode)
}

// withMemMount bind-mounts the family's memory directory read-only at
// memfile.MountPath, replacing any mount already there. runc hands every bind
// mount to CRIU as external (key: the container path, value at restore: the
// host source), so the mount must be there from creation on, for roots and
// forks alike.
func withMemMount(s *specs.Spec, hostDir string) {
	mounts := s.Mounts[:0]
	for _, m := range s.Mounts {
		if filepath.Clean(m.Destination) != memfile.MountPath {
			mounts = append(mounts, m)
		}
	}
	s.Mounts = append(mounts, specs.Mount{
		Destination: memfile.MountPath,
		Type:        "bind",
		Source:      hostDir,
		// No noexec: CRIU maps the files with the protections the memory had,
		// and a JIT's executable heap must stay executable.
		Options: []string{"rbind", "ro", "nosuid", "nodev", "rprivate"},
	})
}

// withOvercommitHook adds the createContainer hook that makes
// /proc/sys/vm/overcommit_memory read the given value. runc refuses spec mounts
// inside /proc, so a hook, running in the container's mount namespace before
// pivot_root, does the bind mount: mount(8) where it can (overcommitMountHook),
// else this binary.
func withOvercommitHook(s *specs.Spec, self, bundle, value string) {
	if s.Hooks == nil {
		s.Hooks = &specs.Hooks{}
	}
	hooks := s.Hooks.CreateContainer[:0]
	for _, h := range s.Hooks.CreateContainer {
		if !isOurHook(h) {
			hooks = append(hooks, h)
		}
	}
	h, ok := overcommitMountHook(s, bundle, value)
	if !ok {
		h = specs.Hook{
			Path: self,
			Args: []string{filepath.Base(self), HookArg, "overcommit", OvercommitFile(value)},
		}
	}
	s.Hooks.CreateContainer = append(hooks, h)
}

func isOurHook(h specs.Hook) bool {
	return len(h.Args) > 1 && h.Args[1] == HookArg || isOvercommitMountHook(h)
}

// ensureOvercommitFile writes the file the hook bind-mounts, once per family.
// Like the memory files it is never modified afterwards.
func ensureOvercommitFile(familyDir, value string) error {
	p := filepath.Join(familyDir, OvercommitFile(value))
	if _, err := os.Stat(p); err == nil {
		return nil
	}
	return writeFileAtomic(p, []byte(value+"\n"), 0o444)
}

// AnnotationCRIUConfig is runc's annotation naming a CRIU configuration file;
// runc passes it to CRIU for checkpoint and restore, and its settings win over
// runc's own (e.g. the log level).
const AnnotationCRIUConfig = "org.criu.config"

// withCRIUConfig points runc at LazyFork's CRIU configuration unless the spec
// names one already that is not LazyFork's (a fork's spec is its parent's,
// with the parent's LazyFork configuration, which may differ).
func withCRIUConfig(s *specs.Spec, path, root string) {
	if cur, ok := s.Annotations[AnnotationCRIUConfig]; ok && !isOurCRIUConfig(cur, root) {
		return
	}
	if s.Annotations == nil {
		s.Annotations = map[string]string{}
	}
	s.Annotations[AnnotationCRIUConfig] = path
}

// isOurCRIUConfig reports whether path is a configuration LazyFork wrote: a
// container's own (criuConfigName, in its bundle) or one an older shim
// shared in root.
func isOurCRIUConfig(path, root string) bool {
	base := filepath.Base(path)
	return base == criuConfigName ||
		filepath.Dir(path) == root && strings.HasPrefix(base, "criu-v") && strings.HasSuffix(base, ".conf")
}

// criuConfigName is a container's own CRIU configuration, in its bundle.
const criuConfigName = "lazyfork-criu.conf"

// criuConfig is the content of a container's CRIU configuration: the log
// level, file locks dumped and restored (CRIU refuses to dump a process
// holding one otherwise), for freezeScript (a restore of a zero-mode
// snapshot) that action script, and for a restore that may leave cgroups to
// runc, manage-cgroups=ignore.
//
// runc puts CRIU into the container's cgroups before a restore (and sets
// their limits); CRIU by default then builds a cgroup yard (a tmpfs with
// every hierarchy mounted in it: 15-25 ms of a 65 ms restore here, most of
// it the cgroup2 mount) to move the restored tasks into the sub-cgroups the
// dump recorded. A container whose tasks cannot have made sub-cgroups
// (cgroupsLeftToRunc) has none to restore, and its tasks inherit CRIU's,
// which are the fork's own. Only restores ignore cgroups: a dump in that mode
// records the tasks' cgroup paths without its hierarchies, and a plain runc
// restore of it (an export) would put the tasks back into the parent's
// cgroups. So the container's file says ignore only until its restore is
// done (restoreDone rewrites it).
func criuConfig(verbosity, freezeScript string, ignoreCgroups bool) string {
	conf := "# LazyFork: CRIU restores inside the fork's memory cgroup; a debug log\n" +
		"# there is page cache charged to every fork. Errors are still logged.\n" +
		"verbosity=" + verbosity + "\n" +
		"# A process holding file locks (SQLite, flock users) is dumped with them;\n" +
		"# each copy takes them again on its own copy of the files.\n" +
		"file-locks\n"
	if freezeScript != "" {
		conf += "# A zero-mode madvise guard: frozen until its supervisor attaches.\n" +
			"action-script " + freezeScript + "\n"
	}
	if ignoreCgroups {
		conf += "# This restore only: runc made the fork's cgroups and put CRIU in them\n" +
			"# (see shim/spec.go, criuConfig).\n" +
			"manage-cgroups=ignore\n"
	}
	return conf
}

// writeCRIUConfig writes a container's CRIU configuration into its bundle
// and returns its path. freezeOnResume writes the zero-mode action script
// into root (once) and names it.
func writeCRIUConfig(bundle, root, verbosity string, freezeOnResume, ignoreCgroups bool) (string, error) {
	script := ""
	if freezeOnResume {
		script = filepath.Join(root, "criu-freeze-on-resume1.sh")
		if _, err := os.Stat(script); err != nil {
			if err := os.MkdirAll(root, 0o755); err != nil {
				return "", err
			}
			if err := writeFileAtomic(script, []byte(freezeOnResumeScript), 0o755); err != nil {
				return "", err
			}
		}
	}
	p := filepath.Join(bundle, criuConfigName)
	return p, writeFileAtomic(p, []byte(criuConfig(verbosity, script, ignoreCgroups)), 0o644)
}

// restoreDone puts back a restored container's CRIU configuration for its
// dumps (cgroups managed), if its restore ignored them.
func restoreDone(bundle string) error {
	p := filepath.Join(bundle, criuConfigName)
	b, err := os.ReadFile(p)
	if err != nil {
		if os.IsNotExist(err) {
			return nil
		}
		return err
	}
	conf := string(b)
	i := strings.Index(conf, "# This restore only:")
	if i < 0 {
		return nil
	}
	return writeFileAtomic(p, []byte(conf[:i]), 0o644)
}

// cgroupsLeftToRunc reports whether a restore of a container with spec s may
// leave cgroups to runc (criuConfig): its processes cannot have made cgroups
// of their own, so all of them sit in the container's, which runc makes. It
// is so when the container has no cgroup namespace (whose restore needs
// CRIU's cgroup handling) and cannot write to any cgroup hierarchy: no
// CAP_SYS_ADMIN (which could mount one) and every cgroup mount, or bind of
// the host's cgroupfs, read-only. (Not covered: a process exec'd into the
// container with more capabilities than its init, and a nested user
// namespace mounting a cgroupfs of its own; their sub-cgroups would be
// flattened into the fork's cgroup.)
func cgroupsLeftToRunc(s *specs.Spec) bool {
	if s.Linux == nil {
		return false
	}
	for _, ns := range s.Linux.Namespaces {
		if ns.Type == specs.CgroupNamespace {
			return false
		}
	}
	if s.Process == nil || s.Process.Capabilities == nil || slices.Contains(s.Process.Capabilities.Bounding, "CAP_SYS_ADMIN") {
		return false
	}
	for _, m := range s.Mounts {
		cg := m.Type == "cgroup" || m.Type == "cgroup2" ||
			underCgroupfs(m.Source) || underCgroupfs(m.Destination)
		if cg && !slices.Contains(m.Options, "ro") {
			return false
		}
	}
	return true
}

// underCgroupfs reports whether path is the host's cgroup mount point or
// under it (a bind of it into a container, as monitoring agents have).
func underCgroupfs(path string) bool {
	p := filepath.Clean(path)
	return p == cgroupRoot || strings.HasPrefix(p, cgroupRoot+"/")
}

// criuEnvConfig is CRIU's configuration for every run a LazyFork shim makes
// (CRIU_CONFIG_FILE, read when criu starts, before runc's request).
//
// network-lock=skip: CRIU otherwise brackets each dump with iptables-restore
// runs in the container's network namespace (40-75 ms of every pause here),
// only to hold packets still for --tcp-established, which LazyFork never
// asks for (a container holding an established TCP connection fails its
// snapshot instead); a restore then skips them too (the method is recorded
// in the image). It cannot go in the org.criu.config file: CRIU 4.1 crashes
// on a network-lock option in a configuration passed over RPC (it checks the
// option against a command word it does not have there).
const criuEnvConfig = "# LazyFork: no iptables lock around dumps and restores (see shim/spec.go).\nnetwork-lock=skip\n"

const criuEnvConfigName = "criu-env.conf"

// setCRIUEnvConfig points the shim's CRIU runs at criuEnvConfig (written in
// dir), unless the environment names a CRIU configuration already.
func setCRIUEnvConfig(dir string) error {
	if os.Getenv("CRIU_CONFIG_FILE") != "" {
		return nil
	}
	p := filepath.Join(dir, criuEnvConfigName)
	if b, err := os.ReadFile(p); err != nil || string(b) != criuEnvConfig {
		if err := os.MkdirAll(dir, 0o755); err != nil {
			return err
		}
		if err := writeFileAtomic(p, []byte(criuEnvConfig), 0o644); err != nil {
			return err
		}
	}
	return os.Setenv("CRIU_CONFIG_FILE", p)
}
