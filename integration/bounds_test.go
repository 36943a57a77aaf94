package integration

import (
	"context"
	"strings"
	"testing"
)

// TestBoundsForkInput: a huge -n, names containerd refuses and names taken
// fail at once, before the parent is paused: no pause event, nothing left.
func TestBoundsForkInput(t *testing.T) {
	e := startCLIEnv(t)
	before := e.startCounterCLI(t, "counter")

	ctx, cancel := context.WithCancel(e.ctx(t))
	defer cancel()
	events, errs := e.Client().Subscribe(ctx, `topic~="/tasks/(paused|checkpointed)"`)
	for _, c := range []struct {
		args []string
		want string
	}{
		{[]string{"--count", "100000"}, "limit of 256"},
		{[]string{"-c", "100000", "--name", "many"}, "limit of 256"},
		{[]string{"--count", "20000000", "--max", "40000000"}, "MemAvailable"},
		{[]string{"--name", "bad/name"}, "bad/name"},
		{[]string{"--name", strings.Repeat("x", 80)}, "identifier"},
		{[]string{"--name", "counter"}, "exists"},
		{[]string{"--count", "0"}, "at least one"},
		// -n is the namespace, as for ctr and nerdctl: the old count form
		// finds no counter in namespace 2, and says where the count went.
		{[]string{"-n", "2"}, "the number of copies is --count or -c"},
	} {
		_, err := e.lf(t, append([]string{"fork", "counter"}, c.args...)...)
		if err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("fork %v: %v, want an error saying %q", c.args, err, c.want)
			continue
		}
		t.Logf("fork %v: %v", c.args, err)
	}
	e.parentRuns(t, "counter")
	select {
	case ev := <-events:
		t.Errorf("the parent was touched: event %s", ev.Topic)
	case err := <-errs:
		t.Fatalf("events: %v", err)
	default:
	}
	assertSame(t, before, e.state(t))
}
