package api

import (
	"fmt"

	runcopts "github.com/containerd/containerd/api/types/runc/options"
	"github.com/containerd/containerd/v2/pkg/protobuf/types"
	"github.com/containerd/errdefs"
	"github.com/containerd/typeurl/v2"
	"google.golang.org/protobuf/proto"

	lazyforkv1 "github.com/lazyfork/lazyfork/proto/lazyfork/v1"
)

// MarshalCheckpointOptions makes the options of a checkpoint request to
// containerd's task service: runc's options, of runc's type (the only one
// containerd takes), carrying LazyFork's (lazyforkv1.CheckpointOptions) as
// fields runc does not know.
func MarshalCheckpointOptions(runc *runcopts.CheckpointOptions, lf *lazyforkv1.CheckpointOptions) (*types.Any, error) {
	a, err := typeurl.MarshalAnyToProto(runc)
	if err != nil {
		return nil, err
	}
	ext, err := proto.Marshal(lf)
	if err != nil {
		return nil, err
	}
	a.Value = append(a.Value, ext...)
	return a, nil
}

// LazyForkCheckpointOptions reads LazyFork's options from a checkpoint
// request's: those MarshalCheckpointOptions put inside runc's, or an Any of
// lazyforkv1.CheckpointOptions itself. No options, or runc's alone (ctr,
// nerdctl), or another kind (CRI), ask for nothing.
func LazyForkCheckpointOptions(a typeurl.Any) (*lazyforkv1.CheckpointOptions, error) {
	lf := &lazyforkv1.CheckpointOptions{}
	if a == nil || len(a.GetValue()) == 0 {
		return lf, nil
	}
	switch {
	case typeurl.Is(a, &runcopts.CheckpointOptions{}), typeurl.Is(a, lf):
		// Unknown fields (runc's, in the first case) are skipped.
		if err := proto.Unmarshal(a.GetValue(), lf); err != nil {
			return nil, fmt.Errorf("checkpoint options of type %q: %v: %w", a.GetTypeUrl(), err, errdefs.ErrInvalidArgument)
		}
	}
	return lf, nil
}

// MarshalSnapshotIntent makes the resources of the task update that tells
// LazyFork's shim about the snapshot its next Pause begins
// (lazyforkv1.SnapshotIntent).
func MarshalSnapshotIntent(in *lazyforkv1.SnapshotIntent) (*types.Any, error) {
	return typeurl.MarshalAnyToProto(in)
}

// SnapshotIntentOf reads a task update's resources as a snapshot intent; ok
// is false for any other update (runc's resources, CRI's).
func SnapshotIntentOf(a typeurl.Any) (in *lazyforkv1.SnapshotIntent, ok bool, err error) {
	in = &lazyforkv1.SnapshotIntent{}
	if a == nil || !typeurl.Is(a, in) {
		return nil, false, nil
	}
	if err := proto.Unmarshal(a.GetValue(), in); err != nil {
		return nil, true, fmt.Errorf("snapshot intent: %v: %w", err, errdefs.ErrInvalidArgument)
	}
	return in, true, nil
}
