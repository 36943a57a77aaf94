package integration

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/containerd/errdefs"

	"github.com/lazyfork/lazyfork/client"
)

// sdkExample is client's Example, with the address, namespace, name and
// LazyFork root of the private stack; it returns what the example prints.
func sdkExample(ctx context.Context, address, namespace, name, root string) (out string, ids, moreIDs []string, err error) {
	c, err := client.Connect(address, namespace, client.WithRoot(root))
	if err != nil {
		return "", nil, nil, err
	}
	defer c.Close()

	agent, err := c.Container(ctx, name)
	if err != nil {
		return "", nil, nil, err
	}
	forks, err := agent.Fork(ctx, 3)
	if err != nil {
		return "", nil, nil, err
	}
	defer forks.Close()

	out, err = forks[0].Exec(ctx, "cat", "/proc/self/cgroup")
	if err != nil {
		return "", nil, nil, err
	}

	more, err := forks[0].Fork(ctx, 2)
	if err != nil {
		return "", nil, nil, err
	}
	defer more.Close()
	return out, forks.IDs(), more.IDs(), nil
}

// TestSDKExample runs the SDK example against a running container and checks
// that what it made ran where it says, and that Close removed all of it.
func TestSDKExample(t *testing.T) {
	e, ctx, img := startLFPython(t)
	c := e.startCounter(t, ctx, img, "agent-"+lfRandom(3), 8)
	c.waitLine(t, ctx, 0, "tick 2")

	out, ids, more, err := sdkExample(ctx, e.Address, e.Namespace, c.id[:9], e.Root)
	if err != nil {
		t.Fatal(err)
	}
	if len(ids) != 3 || len(more) != 2 {
		t.Fatalf("forks %v, forks of a fork %v", ids, more)
	}
	// The exec ran in the first fork: its own cgroup, not the parent's.
	if !strings.Contains(out, ids[0]) || strings.Contains(out, c.id+"\n") {
		t.Errorf("exec output %q: not the cgroup of fork %s", out, ids[0])
	}
	t.Logf("forks %v, forks of %s: %v", ids, ids[0], more)
	for _, id := range append(ids, more...) {
		if _, err := e.Client().LoadContainer(ctx, id); !errdefs.IsNotFound(err) {
			t.Errorf("fork %s still there after Close: %v", id, err)
		}
	}
	// The parent still runs.
	last := c.lastTick(t)
	deadline := time.Now().Add(30 * time.Second)
	for c.lastTick(t) <= last && time.Now().Before(deadline) {
		time.Sleep(50 * time.Millisecond)
	}
	if c.lastTick(t) <= last {
		t.Error("the parent stopped ticking")
	}
	// Errors of the SDK name what is wrong.
	cl, err := client.Connect(e.Address, e.Namespace, client.WithRoot(e.Root))
	if err != nil {
		t.Fatal(err)
	}
	defer cl.Close()
	if _, err := cl.Container(ctx, "nosuch"); !errdefs.IsNotFound(err) {
		t.Errorf("unknown name: %v", err)
	}
}
