package shim

import (
	"os"
	"path/filepath"
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
