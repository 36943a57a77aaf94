package shim

import (
	"os"
	"path/filepath"
	"strings"
	"testing"

	runcopts "github.com/containerd/containerd/api/types/runc/options"
	runtimeoptions "github.com/containerd/containerd/api/types/runtimeoptions/v1"
	"github.com/containerd/errdefs"
	"github.com/containerd/typeurl/v2"
	specs "github.com/opencontainers/runtime-spec/specs-go"
)

// CRI sends a non-runc runtime the handler's [options] as a TOML blob; runc's
// keys in it must reach runc's shim as its own Options.
func TestCreateOptionsFromCRI(t *testing.T) {
	body := "BinaryName = '/usr/local/sbin/runc'\nRoot = \"/tmp/private runc\"\nSystemdCgroup = false\nIoUid = 1000\nSomethingElse = 'x'\n[nested]\nRoot = 'ignored'\n"
	a, err := typeurl.MarshalAnyToProto(&runtimeoptions.Options{TypeUrl: "x", ConfigBody: []byte(body)})
	if err != nil {
		t.Fatal(err)
	}
	out, err := createOptions(a)
	if err != nil {
		t.Fatal(err)
	}
	v, err := typeurl.UnmarshalAny(out)
	if err != nil {
		t.Fatal(err)
	}
	ro, ok := v.(*runcopts.Options)
	if !ok {
		t.Fatalf("got %T, want runc options", v)
	}
	if ro.BinaryName != "/usr/local/sbin/runc" || ro.Root != "/tmp/private runc" || ro.SystemdCgroup || ro.IoUid != 1000 {
		t.Errorf("translated options %+v", ro)
	}
}

func TestCreateOptionsKeepsRunc(t *testing.T) {
	a, err := typeurl.MarshalAnyToProto(&runcopts.Options{Root: "/r"})
	if err != nil {
		t.Fatal(err)
	}
	out, err := createOptions(a)
	if err != nil || out != a {
		t.Fatalf("runc options changed: %v %v", out, err)
	}
	if out, err := createOptions(nil); err != nil || out != nil {
		t.Fatalf("nil options: %v %v", out, err)
	}
}

func TestCreateOptionsRejectsOthers(t *testing.T) {
	a, err := typeurl.MarshalAnyToProto(&runcopts.CheckpointOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := createOptions(a); !errdefs.IsInvalidArgument(err) {
		t.Fatalf("checkpoint options as task options: %v, want invalid argument", err)
	}
	bad, err := typeurl.MarshalAnyToProto(&runtimeoptions.Options{ConfigBody: []byte("Root = unquoted\n")})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := createOptions(bad); !errdefs.IsInvalidArgument(err) {
		t.Fatalf("bad TOML: %v, want invalid argument", err)
	}
}

// No options (what CRI sends) or foreign ones mean a leave-running checkpoint.
func TestCheckpointOptions(t *testing.T) {
	o, keep, err := checkpointOptions(nil)
	if err != nil || keep || o.Exit {
		t.Fatalf("nil: %+v %v %v", o, keep, err)
	}
	a, _ := typeurl.MarshalAnyToProto(&runcopts.CheckpointOptions{Exit: true, ImagePath: "/x"})
	o, keep, err = checkpointOptions(a)
	if err != nil || !keep || !o.Exit || o.ImagePath != "/x" {
		t.Fatalf("runc: %+v %v %v", o, keep, err)
	}
	g, _ := typeurl.MarshalAnyToProto(&runtimeoptions.Options{})
	o, keep, err = checkpointOptions(g)
	if err != nil || keep || o.Exit {
		t.Fatalf("generic: %+v %v %v", o, keep, err)
	}
}

func TestSpecEdits(t *testing.T) {
	s := &specs.Spec{Mounts: []specs.Mount{{Destination: "/proc"}, {Destination: "/.lazyfork/mem/", Source: "/old"}}}
	withMemMount(s, "/run/lazyfork/mem/fam")
	withMemMount(s, "/run/lazyfork/mem/fam")
	n := 0
	for _, m := range s.Mounts {
		if m.Destination == "/.lazyfork/mem" {
			n++
			if m.Source != "/run/lazyfork/mem/fam" {
				t.Errorf("mount source %s", m.Source)
			}
		}
	}
	if n != 1 || len(s.Mounts) != 2 {
		t.Errorf("mounts %+v", s.Mounts)
	}
	// No procfs mount at /proc: the shim binary is the hook.
	withOvercommitHook(s, "/bin/shim", "/b", "2")
	withOvercommitHook(s, "/bin/shim", "/b", "2")
	if len(s.Hooks.CreateContainer) != 1 || s.Hooks.CreateContainer[0].Args[3] != OvercommitFile("2") {
		t.Errorf("hooks %+v", s.Hooks.CreateContainer)
	}
	// With one and mount(8): one mount run, replacing the binary's hook.
	if mountBinary() != "" {
		s.Mounts[0].Type = "proc"
		s.Root = &specs.Root{Path: "rootfs"}
		withOvercommitHook(s, "/bin/shim", "/b", "2")
		withOvercommitHook(s, "/bin/shim", "/b", "2")
		want := []string{"mount", "--bind", "-o", "ro,nosuid,nodev,noexec", "/b/rootfs/.lazyfork/mem/" + OvercommitFile("2"), "/b/rootfs/proc/sys/vm/overcommit_memory"}
		if len(s.Hooks.CreateContainer) != 1 || strings.Join(s.Hooks.CreateContainer[0].Args, " ") != strings.Join(want, " ") {
			t.Errorf("hooks %+v, want one with args %q", s.Hooks.CreateContainer, want)
		}
	}
	dir := t.TempDir()
	if err := ensureOvercommitFile(dir, "2"); err != nil {
		t.Fatal(err)
	}
	b, err := os.ReadFile(filepath.Join(dir, OvercommitFile("2")))
	if err != nil || string(b) != "2\n" {
		t.Errorf("overcommit file %q %v", b, err)
	}
}

func TestConfigFromEnv(t *testing.T) {
	t.Setenv("LAZYFORK_ROOT", "relative")
	if _, err := ConfigFromEnv(); !errdefs.IsInvalidArgument(err) {
		t.Errorf("relative root: %v", err)
	}
	t.Setenv("LAZYFORK_ROOT", "/tmp/x")
	t.Setenv("LAZYFORK_OVERCOMMIT", "off")
	c, err := ConfigFromEnv()
	if err != nil || c.Overcommit != "" || c.MemRoot() != "/tmp/x/mem" || c.TmpfsSize <= 0 {
		t.Errorf("config %+v %v", c, err)
	}
	if !c.Rehome || !c.PreCopy || c.PreCopyMin != DefaultPreCopyMin {
		t.Errorf("the move and its precopy are not on by default: %+v", c)
	}
	t.Setenv("LAZYFORK_PRECOPY", "off")
	if c, err := ConfigFromEnv(); err != nil || c.PreCopy || !c.Rehome {
		t.Errorf("LAZYFORK_PRECOPY=off: %+v %v", c, err)
	}
	t.Setenv("LAZYFORK_PRECOPY", "16M")
	if c, err := ConfigFromEnv(); err != nil || !c.PreCopy || c.PreCopyMin != 16<<20 {
		t.Errorf("LAZYFORK_PRECOPY=16M: %+v %v", c, err)
	}
	t.Setenv("LAZYFORK_PRECOPY", "1GiB")
	if c, err := ConfigFromEnv(); err != nil || c.PreCopyMin != 1<<30 {
		t.Errorf("LAZYFORK_PRECOPY=1GiB: %+v %v", c, err)
	}
	t.Setenv("LAZYFORK_PRECOPY", "sometimes")
	if _, err := ConfigFromEnv(); !errdefs.IsInvalidArgument(err) {
		t.Errorf("LAZYFORK_PRECOPY=sometimes: %v", err)
	}
	t.Setenv("LAZYFORK_PRECOPY", "")
	t.Setenv("LAZYFORK_OVERCOMMIT", "3")
	if _, err := ConfigFromEnv(); !errdefs.IsInvalidArgument(err) {
		t.Errorf("overcommit 3: %v", err)
	}
}
