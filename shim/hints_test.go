package shim

import (
	"errors"
	"strings"
	"testing"

	"github.com/containerd/errdefs"
	"github.com/containerd/errdefs/pkg/errgrpc"
)

func TestWithSnapshotHint(t *testing.T) {
	busy := errgrpc.ToGRPC(errors.New("OCI runtime restore failed: container's cgroup is not empty: 2 process(es) found"))
	got := withSnapshotHint(busy)
	if !strings.Contains(got.Error(), "lazyfork fork") || !strings.Contains(got.Error(), "lazyfork export") || !strings.Contains(got.Error(), "cgroup is not empty") {
		t.Errorf("busy cgroup: %v", got)
	}
	other := errgrpc.ToGRPC(errdefs.ErrNotFound)
	if got := withSnapshotHint(other); got != other {
		t.Errorf("other error changed: %v", got)
	}
}
