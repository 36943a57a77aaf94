package integration

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/containerd/containerd/v2/client"

	"github.com/lazyfork/lazyfork/integration/harness"
)

// TestForkInetSocketSaysWhy: a container holding a TCP socket forks, or, with
// a CRIU that cannot dump inet sockets on this kernel (CRIU 4.1.1 asks every
// socket for SO_PASSCRED and SO_PASSSEC, which Linux 6.16 and later refuse
// for inet sockets), the fork fails saying so and what to do, and the parent
// runs on untouched. Before, the error was CRIU's "Can't get 1:34 opt".
func TestForkInetSocketSaysWhy(t *testing.T) {
	e, ctx, img := startLFPython(t)
	id := "sock-" + lfRandom(3)
	_, task := e.run(t, ctx, img, id, []string{"python3", "-c",
		`import socket, time
s = socket.socket(); s.bind(("0.0.0.0", 0)); s.listen()
print("listening", flush=True)
while True: time.sleep(0.05)`})
	wctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	if _, err := harness.WaitLine(wctx, e.TaskLogPath(id), 0, func(l string) bool { return strings.HasPrefix(l, "listening") }); err != nil {
		t.Fatalf("%s: never listened: %v", id, err)
	}
	res, err := e.lfClient().Fork(ctx, id, 1, e.logIO())
	switch {
	case err == nil:
		t.Logf("this CRIU dumps inet sockets: forked %s", res.Forks[0].Container.ID())
	case strings.Contains(err.Error(), "Can't get 1:"):
		if !strings.Contains(err.Error(), "cannot dump a process holding a TCP or UDP socket") || !strings.Contains(err.Error(), "4b7398595") {
			t.Errorf("fork of a container holding a TCP socket failed without saying why: %v", err)
		} else {
			t.Logf("as expected with this CRIU: %v", err)
		}
	default:
		t.Fatalf("fork: %v", err)
	}
	if st, err := task.Status(ctx); err != nil || st.Status != client.Running {
		t.Errorf("parent after the fork: %v %v, want running", st.Status, err)
	}
}
