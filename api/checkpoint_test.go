package api

import (
	"testing"

	runcopts "github.com/containerd/containerd/api/types/runc/options"
	"github.com/containerd/typeurl/v2"
	"google.golang.org/protobuf/types/known/anypb"

	lazyforkv1 "github.com/lazyfork/lazyfork/proto/lazyfork/v1"
)

// The options travel as runc's: containerd (which reads the image path from
// them) and runc's shim see runc's options, LazyFork's shim sees its own.
func TestCheckpointOptionsRideInRuncs(t *testing.T) {
	a, err := MarshalCheckpointOptions(&runcopts.CheckpointOptions{ImagePath: "/run/lazyfork/snapshots/s/image", Exit: false},
		&lazyforkv1.CheckpointOptions{ThawAfterDump: true})
	if err != nil {
		t.Fatal(err)
	}
	v, err := typeurl.UnmarshalAny(a)
	if err != nil {
		t.Fatalf("containerd cannot read the options: %v", err)
	}
	ro, ok := v.(*runcopts.CheckpointOptions)
	if !ok || ro.ImagePath != "/run/lazyfork/snapshots/s/image" {
		t.Fatalf("containerd reads %T %+v, want runc's options with the image path", v, v)
	}
	lf, err := LazyForkCheckpointOptions(a)
	if err != nil || !lf.GetThawAfterDump() {
		t.Fatalf("the shim reads %+v, %v; want thaw_after_dump", lf, err)
	}
	// ctr and nerdctl: runc's options alone; CRI: none.
	plain, _ := typeurl.MarshalAnyToProto(&runcopts.CheckpointOptions{ImagePath: "/x", Exit: true})
	for _, in := range []typeurl.Any{plain, nil} {
		if lf, err := LazyForkCheckpointOptions(in); err != nil || lf.GetThawAfterDump() {
			t.Fatalf("plain options read as %+v, %v; want nothing asked", lf, err)
		}
	}
}

// A snapshot intent reads back as sent, and no other update reads as one
// (CRI's and ctr's updates carry runc's resources, which the shim passes on).
func TestSnapshotIntent(t *testing.T) {
	a, err := MarshalSnapshotIntent(&lazyforkv1.SnapshotIntent{Forks: 100})
	if err != nil {
		t.Fatal(err)
	}
	in, ok, err := SnapshotIntentOf(a)
	if err != nil || !ok || in.GetForks() != 100 {
		t.Fatalf("read back %+v, %v, %v; want 100 forks", in, ok, err)
	}
	other, _ := typeurl.MarshalAnyToProto(&runcopts.Options{SystemdCgroup: true})
	for _, a := range []typeurl.Any{other, nil, (*anypb.Any)(nil)} {
		if in, ok, err := SnapshotIntentOf(a); ok || err != nil || in != nil {
			t.Fatalf("%v read as an intent: %+v, %v, %v", a, in, ok, err)
		}
	}
	a.Value = []byte{0xff}
	if _, ok, err := SnapshotIntentOf(a); !ok || err == nil {
		t.Fatalf("a torn intent: ok %v, err %v; want an error", ok, err)
	}
}
