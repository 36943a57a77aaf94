package client

import (
	"context"
	"errors"
	"io"
	"testing"

	"github.com/containerd/errdefs"
)

func TestCheckCount(t *testing.T) {
	if err := checkCount("p", 100000, DefaultMaxForks); !errdefs.IsInvalidArgument(err) {
		t.Errorf("n = 100000: %v", err)
	}
	if err := checkCount("p", DefaultMaxForks, DefaultMaxForks); err != nil {
		t.Errorf("n = limit: %v", err)
	}
	if err := checkMemory("p", 1<<40, 1<<30); !errdefs.IsResourceExhausted(err) {
		t.Errorf("2^40 forks: %v", err)
	}
}

// An operation is alive while its call holds its lock; its record goes with
// done, and a call that ends without done leaves a dead record to Reconcile.
func TestOpRecord(t *testing.T) {
	ctx := context.Background()
	c := New(nil, WithRoot(t.TempDir()))
	o, err := c.newOp(ctx, "ns", "parent")
	if err != nil {
		t.Fatal(err)
	}
	ops, err := c.node.Ops(ctx)
	if err != nil || len(ops) != 1 || !ops[0].Alive || ops[0].Record.Parent != "parent" {
		t.Fatalf("records %+v, %v", ops, err)
	}
	if err := o.done(ctx); err != nil {
		t.Fatal(err)
	}
	if ops, _ := c.node.Ops(ctx); len(ops) != 0 {
		t.Errorf("record left: %+v", ops)
	}
	o2, err := c.newOp(ctx, "ns", "parent")
	if err != nil {
		t.Fatal(err)
	}
	o2.release()
	if ops, _ := c.node.Ops(ctx); len(ops) != 1 || ops[0].Alive {
		t.Errorf("released operation: %+v", ops)
	}
}

func TestFailpoint(t *testing.T) {
	failpointOut = io.Discard
	t.Setenv("LAZYFORK_FAILPOINT", FailAfterPause+":sleep=1h")
	if err := failpoint(context.Background(), FailAfterCheckpt); err != nil {
		t.Errorf("another stage: %v", err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	if err := failpoint(ctx, FailAfterPause); !errors.Is(err, context.Canceled) {
		t.Errorf("a cancelled sleep: %v", err)
	}
}

func TestLockParent(t *testing.T) {
	c := New(nil, WithRoot(t.TempDir()))
	unlock, err := c.lockParent(context.Background(), "ns", "p")
	if err != nil {
		t.Fatal(err)
	}
	if _, ok, _ := c.tryLockParent(context.Background(), "ns", "p"); ok {
		t.Error("a second lock of one parent was granted")
	}
	if u, ok, _ := c.tryLockParent(context.Background(), "ns", "q"); !ok {
		t.Error("another parent's lock was refused")
	} else {
		u()
	}
	unlock()
	if u, ok, _ := c.tryLockParent(context.Background(), "ns", "p"); !ok {
		t.Error("lock not released")
	} else {
		u()
	}
}
