package shim

import (
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"

	specs "github.com/opencontainers/runtime-spec/specs-go"

	"github.com/lazyfork/lazyfork/internal/testutil"
)

// TestWriteSpecReadableByMappedRoot: the rewritten config.json keeps the mode
// containerd gave it, and with a user namespace the container's mapped root
// group can read it (LazyFork's createContainer hook runs as that user).
func TestWriteSpecReadableByMappedRoot(t *testing.T) {
	testutil.RequiresRoot(t) // chown to the mapped group
	dir := t.TempDir()
	path := filepath.Join(dir, specFile)
	if err := os.WriteFile(path, []byte("{}"), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.Chmod(path, 0o644); err != nil {
		t.Fatal(err)
	}
	s := &specs.Spec{Version: "1.2.0", Linux: &specs.Linux{}}
	if err := writeSpec(dir, s); err != nil {
		t.Fatal(err)
	}
	if fi, err := os.Stat(path); err != nil || fi.Mode().Perm() != 0o644 {
		t.Fatalf("config.json without user namespace: %v %v, want mode 0644 as containerd wrote it", fi.Mode(), err)
	}

	const hostGID = 65536 * 3
	if err := os.Chmod(path, 0o600); err != nil {
		t.Fatal(err)
	}
	s.Linux.GIDMappings = []specs.LinuxIDMapping{{ContainerID: 0, HostID: hostGID, Size: 65536}}
	if err := writeSpec(dir, s); err != nil {
		t.Fatal(err)
	}
	fi, err := os.Stat(path)
	if err != nil {
		t.Fatal(err)
	}
	st := fi.Sys().(*syscall.Stat_t)
	if st.Gid != hostGID || fi.Mode().Perm()&0o040 == 0 {
		t.Errorf("config.json with user namespace: mode %v group %d, want group-readable by %d (the mapped root)", fi.Mode(), st.Gid, hostGID)
	}
	if got, err := readSpec(dir); err != nil || got.Linux == nil || len(got.Linux.GIDMappings) != 1 {
		t.Errorf("spec read back: %+v %v", got, err)
	}
}

// containerdSpec is the spec shape containerd's defaults give a container:
// no cgroup namespace on a v1 host, no CAP_SYS_ADMIN, cgroupfs read-only.
func containerdSpec() *specs.Spec {
	return &specs.Spec{
		Process: &specs.Process{Capabilities: &specs.LinuxCapabilities{Bounding: []string{"CAP_CHOWN", "CAP_KILL", "CAP_NET_BIND_SERVICE"}}},
		Mounts: []specs.Mount{
			{Destination: "/proc", Type: "proc", Source: "proc"},
			{Destination: "/sys/fs/cgroup", Type: "cgroup", Source: "cgroup", Options: []string{"nosuid", "noexec", "nodev", "relatime", "ro"}},
		},
		Linux: &specs.Linux{Namespaces: []specs.LinuxNamespace{{Type: specs.PIDNamespace}, {Type: specs.MountNamespace}, {Type: specs.NetworkNamespace}}},
	}
}

// A restore leaves cgroups to runc only for a container whose processes
// cannot have made cgroups of their own.
func TestCgroupsLeftToRunc(t *testing.T) {
	if !cgroupsLeftToRunc(containerdSpec()) {
		t.Errorf("containerd's default spec: cgroups not left to runc")
	}
	ro := containerdSpec()
	ro.Mounts = append(ro.Mounts, specs.Mount{Destination: "/host/cgroup", Type: "bind", Source: "/sys/fs/cgroup", Options: []string{"rbind", "ro"}})
	if !cgroupsLeftToRunc(ro) {
		t.Errorf("a read-only bind of the host's cgroupfs: cgroups not left to runc")
	}
	for name, change := range map[string]func(*specs.Spec){
		"cgroup namespace": func(s *specs.Spec) {
			s.Linux.Namespaces = append(s.Linux.Namespaces, specs.LinuxNamespace{Type: specs.CgroupNamespace})
		},
		"CAP_SYS_ADMIN": func(s *specs.Spec) {
			s.Process.Capabilities.Bounding = append(s.Process.Capabilities.Bounding, "CAP_SYS_ADMIN")
		},
		"writable cgroupfs": func(s *specs.Spec) { s.Mounts[1].Options = []string{"nosuid", "rw"} },
		"writable cgroup2": func(s *specs.Spec) {
			s.Mounts = append(s.Mounts, specs.Mount{Destination: "/sys/fs/cgroup/unified", Type: "cgroup2"})
		},
		"no capabilities": func(s *specs.Spec) { s.Process.Capabilities = nil },
		"bind of the host's cgroupfs": func(s *specs.Spec) {
			s.Mounts = append(s.Mounts, specs.Mount{Destination: "/host/cgroup", Type: "bind", Source: "/sys/fs/cgroup", Options: []string{"rbind"}})
		},
		"no linux section": func(s *specs.Spec) { s.Linux = nil },
	} {
		s := containerdSpec()
		change(s)
		if cgroupsLeftToRunc(s) {
			t.Errorf("%s: cgroups left to runc", name)
		}
	}
}

// A container's CRIU configuration ignores cgroups for its restore only:
// restoreDone takes that out again before any dump, and keeps the rest.
func TestCRIUConfigIgnoresCgroupsForTheRestoreOnly(t *testing.T) {
	bundle, root := t.TempDir(), t.TempDir()
	p, err := writeCRIUConfig(bundle, root, "1", true, true)
	if err != nil {
		t.Fatal(err)
	}
	b, _ := os.ReadFile(p)
	for _, want := range []string{"verbosity=1\n", "file-locks\n", "action-script " + filepath.Join(root, "criu-freeze-on-resume1.sh") + "\n", "manage-cgroups=ignore\n"} {
		if !strings.Contains(string(b), want) {
			t.Errorf("restore configuration %q lacks %q", b, want)
		}
	}
	if err := restoreDone(bundle); err != nil {
		t.Fatal(err)
	}
	after, _ := os.ReadFile(p)
	if strings.Contains(string(after), "manage-cgroups") {
		t.Errorf("after the restore the configuration still says %q", after)
	}
	if want := criuConfig("1", filepath.Join(root, "criu-freeze-on-resume1.sh"), false); string(after) != want {
		t.Errorf("after the restore: %q, want the dump configuration %q", after, want)
	}
	// Idempotent, and a bundle without a file (an older shim's) is fine.
	if err := restoreDone(bundle); err != nil {
		t.Fatal(err)
	}
	if err := restoreDone(t.TempDir()); err != nil {
		t.Fatal(err)
	}
	// The annotation names the container's file; another tool's stays.
	s := containerdSpec()
	withCRIUConfig(s, p, root)
	if s.Annotations[AnnotationCRIUConfig] != p {
		t.Errorf("annotation %q, want %q", s.Annotations[AnnotationCRIUConfig], p)
	}
	s.Annotations[AnnotationCRIUConfig] = "/etc/criu/other.conf"
	withCRIUConfig(s, p, root)
	if s.Annotations[AnnotationCRIUConfig] != "/etc/criu/other.conf" {
		t.Errorf("another tool's configuration replaced: %q", s.Annotations[AnnotationCRIUConfig])
	}
	s.Annotations[AnnotationCRIUConfig] = filepath.Join(root, "criu-v1-locks.conf") // an older shim's
	withCRIUConfig(s, p, root)
	if s.Annotations[AnnotationCRIUConfig] != p {
		t.Errorf("an older shim's configuration kept: %q", s.Annotations[AnnotationCRIUConfig])
	}
}
