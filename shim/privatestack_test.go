package shim

import (
	"testing"

	runcopts "github.com/containerd/containerd/api/types/runc/options"
	"github.com/containerd/typeurl/v2"
	specs "github.com/opencontainers/runtime-spec/specs-go"
)

// A private stack's runc root and cgroup parent apply to what containerd gave
// by default, never over what a container (or CRI) chose.
func TestPrivateStack(t *testing.T) {
	c := Config{RuncRoot: "/s/runc", CgroupParent: "/lazyfork/stack-1/containers"}
	spec := &specs.Spec{Linux: &specs.Linux{CgroupsPath: "/ns/c1"}}
	opts, err := c.privateStack(nil, spec, "ns", "c1")
	if err != nil {
		t.Fatal(err)
	}
	if spec.Linux.CgroupsPath != "/lazyfork/stack-1/containers/ns/c1" {
		t.Errorf("cgroupsPath %s", spec.Linux.CgroupsPath)
	}
	v, err := typeurl.UnmarshalAny(opts)
	if err != nil || v.(*runcopts.Options).Root != "/s/runc" {
		t.Errorf("options %v %v, want Root /s/runc", v, err)
	}

	// CRI's own cgroup and a runc root in the options stay.
	spec = &specs.Spec{Linux: &specs.Linux{CgroupsPath: "/kubepods/pod1/c1"}}
	own, _ := typeurl.MarshalAnyToProto(&runcopts.Options{Root: "/mine", SystemdCgroup: false, BinaryName: "runc"})
	opts, err = c.privateStack(own, spec, "k8s.io", "c1")
	if err != nil {
		t.Fatal(err)
	}
	if spec.Linux.CgroupsPath != "/kubepods/pod1/c1" {
		t.Errorf("CRI's cgroupsPath changed: %s", spec.Linux.CgroupsPath)
	}
	if v, _ := typeurl.UnmarshalAny(opts); v.(*runcopts.Options).Root != "/mine" {
		t.Errorf("the container's runc root was replaced: %v", v)
	}
	// Options without a root get the stack's, keeping the rest.
	some, _ := typeurl.MarshalAnyToProto(&runcopts.Options{BinaryName: "runc-x"})
	opts, _ = c.privateStack(some, &specs.Spec{}, "ns", "c2")
	if v, _ := typeurl.UnmarshalAny(opts); v.(*runcopts.Options).Root != "/s/runc" || v.(*runcopts.Options).BinaryName != "runc-x" {
		t.Errorf("options %v", v)
	}
	// Without the settings (the node's containerd) nothing changes.
	spec = &specs.Spec{Linux: &specs.Linux{CgroupsPath: "/ns/c1"}}
	if opts, _ := (Config{}).privateStack(nil, spec, "ns", "c1"); opts != nil || spec.Linux.CgroupsPath != "/ns/c1" {
		t.Errorf("no private stack: %v %s", opts, spec.Linux.CgroupsPath)
	}
}
