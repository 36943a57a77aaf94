package client

import (
	"strings"
	"testing"

	"github.com/containerd/containerd/v2/core/mount"
	"github.com/containerd/containerd/v2/pkg/oci"
	"github.com/containerd/errdefs"
	specs "github.com/opencontainers/runtime-spec/specs-go"

	"github.com/lazyfork/lazyfork/api"
)

func TestForkCgroupsPath(t *testing.T) {
	for _, tc := range []struct{ in, want string }{
		{"/default/p", "/default/f"},
		{"/lfh-1/p", "/lfh-1/f"},
		{"/k8s/other", "/k8s/f"},
		{"system.slice:cri:p", "system.slice:cri:f"},
		{"", ""},
	} {
		if got := forkCgroupsPath(tc.in, "p", "f"); got != tc.want {
			t.Errorf("%q -> %q, want %q", tc.in, got, tc.want)
		}
	}
}

func TestForkSpec(t *testing.T) {
	parent := &oci.Spec{Linux: &specs.Linux{CgroupsPath: "/ns/p"}, Annotations: map[string]string{"a": "b"}}
	s, err := forkSpec(parent, "p", "f", "fam", "fam-x-0")
	if err != nil {
		t.Fatal(err)
	}
	if s.Linux.CgroupsPath != "/ns/f" || s.Annotations[api.AnnotationFamily] != "fam" || s.Annotations["a"] != "b" {
		t.Errorf("fork spec %+v %v", s.Linux, s.Annotations)
	}
	if parent.Linux.CgroupsPath != "/ns/p" || parent.Annotations[api.AnnotationFamily] != "" {
		t.Errorf("parent spec changed")
	}
	if _, err := forkSpec(&oci.Spec{}, "p", "f", "fam", ""); !errdefs.IsInvalidArgument(err) {
		t.Errorf("spec without linux: %v", err)
	}
}

func TestUpperOf(t *testing.T) {
	up, err := upperOf([]mount.Mount{{Type: "overlay", Options: []string{"lowerdir=/l", "upperdir=/u", "workdir=/w"}}})
	if err != nil || up != "/u" {
		t.Errorf("overlay: %q %v", up, err)
	}
	up, err = upperOf([]mount.Mount{{Type: "bind", Source: "/s", Options: []string{"rbind", "rw"}}})
	if err != nil || up != "/s" {
		t.Errorf("bind: %q %v", up, err)
	}
	if _, err := upperOf([]mount.Mount{{Type: "bind", Source: "/s", Options: []string{"ro"}}}); !errdefs.IsNotImplemented(err) {
		t.Errorf("read-only bind: %v", err)
	}
}

func TestForkID(t *testing.T) {
	id := forkID(strings.Repeat("x", 100))
	if len(id) > 76 {
		t.Errorf("fork id %d characters", len(id))
	}
	if a, b := forkID("fam"), forkID("fam"); a == b || !strings.HasPrefix(a, "fam-") {
		t.Errorf("fork ids %q %q", a, b)
	}
}
