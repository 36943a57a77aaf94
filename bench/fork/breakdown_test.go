package main

import (
	"os"
	"path/filepath"
	"testing"
	"time"
)

// CRIU's restore log splits into the breakdown's phases; the tar+gzip of a
// tmpfs with contents shows as a gap after its "Mounting tmpfs" line.
func TestCRIUMarks(t *testing.T) {
	log := `(00.000000) Parsing config file /x/criu-env.conf
(00.000557) Loaded kdat cache from /run/criu.kdat
(00.003558) cg: Preparing cgroups yard (cgroups restore mode 0x4)
(00.010946)      1: mnt: Restoring mount namespace
(00.011405)      1: mnt-v2: 	Mounting tmpfs @121 (0)
(00.011492)      1: mnt-v2: 	Mounting tmpfs @122 (0)
(00.024587)      1: mnt-v2: 		Propagate 128 to 132
(00.056346) Running post-setup-namespaces scripts
(00.057943) pie: 1: Switched to the restorer 1
(00.070266) 	RPC
`
	marks, end, kdat, n, d := criuMarks([]byte(log))
	want := map[string]time.Duration{"probed": 3558 * time.Microsecond, "ns": 10946 * time.Microsecond,
		"mounts": 56346 * time.Microsecond, "files": 57943 * time.Microsecond}
	for k, v := range want {
		if marks[k] != v {
			t.Errorf("mark %s = %v, want %v", k, marks[k], v)
		}
	}
	if end != 70266*time.Microsecond || kdat != "loaded" || n != 1 || d != (24587-11492)*time.Microsecond {
		t.Errorf("end %v, kdat %q, tmpfs %d in %v", end, kdat, n, d)
	}
}

// containerd's debug log gives the fork's create, shim, created, restored and
// started times, and the shim's own restore duration.
func TestContainerdMarks(t *testing.T) {
	log := `time="2026-12-01T20:48:37.292957423Z" level=debug msg="creating task" id=f1 runtime=io.containerd.lazyfork.v1
time="2026-12-01T20:48:37.300000000Z" level=debug msg="creating task" id=other runtime=io.containerd.lazyfork.v1
time="2026-12-01T20:48:37.311701976Z" level=info msg="connecting to shim f1" address="unix:///s/x" namespace=n protocol=ttrpc version=3
time="2026-12-01T20:48:37.328205478Z" level=debug msg="lazyfork: created" id=f1 prepare=8.687352ms runc_create=1.330503ms runtime=io.containerd.lazyfork.v1
time="2026-12-01T20:48:37.514481767Z" level=debug msg="lazyfork: restored" id=f1 restore=184.510797ms runtime=io.containerd.lazyfork.v1
time="2026-12-01T20:48:37.518481767Z" level=debug msg="lazyfork: started" after_restore=4ms id=f1 runtime=io.containerd.lazyfork.v1
`
	p := filepath.Join(t.TempDir(), "containerd.log")
	if err := os.WriteFile(p, []byte(log), 0o600); err != nil {
		t.Fatal(err)
	}
	marks, restore, err := containerdMarks(p, 0, "f1")
	if err != nil {
		t.Fatal(err)
	}
	if restore != 184510797*time.Nanosecond {
		t.Errorf("restore %v", restore)
	}
	if got := marks["shim"].Sub(marks["create"]); got != 18744553*time.Nanosecond {
		t.Errorf("shim start %v", got)
	}
	if got := marks["started"].Sub(marks["restored"]); got != 4*time.Millisecond {
		t.Errorf("after restore %v", got)
	}
	if _, _, err := containerdMarks(p, 0, "other"); err == nil {
		t.Error("a fork without shim lines: no error")
	}
}
