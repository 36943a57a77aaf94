package harness

import (
	"context"
	"testing"
)

// StartT starts a private containerd for t and registers its teardown with
// t.Cleanup. When t has failed, containerd's log is printed first. A failure to
// start fails t (the caller gates the test with testutil.RequiresRoot & co).
func StartT(t testing.TB, opts Options) *Containerd {
	t.Helper()
	c, err := Start(context.Background(), opts)
	if err != nil {
		t.Fatalf("harness: %v", err)
	}
	t.Cleanup(func() {
		if t.Failed() {
			t.Logf("containerd log (%s):\n%s", c.LogPath, c.Log())
		}
		if err := c.Stop(); err != nil {
			t.Errorf("harness teardown: %v", err)
		}
	})
	return c
}
