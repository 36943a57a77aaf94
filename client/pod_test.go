package client

import (
	"context"
	"testing"

	"github.com/containerd/errdefs"
)

// A fork-of that is neither an id nor NAMESPACE/POD/CONTAINER is refused
// before containerd is asked anything (the client here has none).
func TestSnapshotForPodRefusesMalformedRef(t *testing.T) {
	c := New(nil, WithRoot(t.TempDir()))
	for _, ref := range []string{"default/web", "a/b/c/d"} {
		if _, err := c.SnapshotForPod(context.Background(), ref, t.TempDir(), "default"); !errdefs.IsInvalidArgument(err) {
			t.Errorf("fork-of %q: %v, want invalid argument", ref, err)
		}
	}
}
