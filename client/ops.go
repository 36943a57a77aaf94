package client

import (
	"context"
	"fmt"
	"io"
	"os"
	"strings"
	"sync"
	"time"

	"github.com/containerd/errdefs"

	"github.com/lazyfork/lazyfork/api"
	"github.com/lazyfork/lazyfork/node"
)

// opRecord is the intent journal of one Fork call (api.OpRecord): what it
// may have made, so that whoever finds it after the call died (Reconcile)
// can undo it. The node keeps it (ROOT/ops); the call holds its op lock
// (node.OpLock) while it runs, released by done or by the call's death.
type opRecord = api.OpRecord

// op is a running operation: its record, saved on every change.
type op struct {
	c      *Client
	mu     sync.Mutex
	rec    opRecord
	unlock func()
}

// newOp writes the record of a new operation on parent in namespace ns,
// holding its op lock first: a record seen is alive while its call is.
func (c *Client) newOp(ctx context.Context, ns, parent string) (*op, error) {
	id := randomHex(8)
	unlock, ok, err := c.node.Lock(ctx, node.OpLock(id), false)
	if err == nil && !ok {
		err = fmt.Errorf("operation %s: its lock is taken: %w", id, errdefs.ErrAlreadyExists)
	}
	if err != nil {
		return nil, fmt.Errorf("operation record: %w", err)
	}
	o := &op{c: c, unlock: unlock, rec: opRecord{ID: id, Namespace: ns, Parent: parent, Created: time.Now().UTC()}}
	if err := o.save(ctx); err != nil {
		unlock()
		return nil, err
	}
	return o, nil
}

// update changes the record and saves it.
func (o *op) update(ctx context.Context, f func(r *opRecord)) error {
	o.mu.Lock()
	defer o.mu.Unlock()
	f(&o.rec)
	return o.saveLocked(ctx)
}

func (o *op) save(ctx context.Context) error {
	o.mu.Lock()
	defer o.mu.Unlock()
	return o.saveLocked(ctx)
}

func (o *op) saveLocked(ctx context.Context) error {
	if err := o.c.node.SaveOp(context.WithoutCancel(ctx), &o.rec); err != nil {
		return fmt.Errorf("operation record %s: %w", o.rec.ID, err)
	}
	return nil
}

// snapshot is a copy of the record.
func (o *op) snapshot() *opRecord {
	o.mu.Lock()
	defer o.mu.Unlock()
	r := o.rec
	r.Forks = append([]string(nil), o.rec.Forks...)
	return &r
}

// done removes the record: everything it lists is gone or owned elsewhere.
func (o *op) done(ctx context.Context) error {
	err := o.c.node.RemoveOp(context.WithoutCancel(ctx), o.rec.ID)
	if err == nil {
		o.release()
	}
	return err
}

// release lets go of the op lock, leaving a record (if any) to Reconcile.
func (o *op) release() {
	if o.unlock != nil {
		o.unlock()
		o.unlock = nil
	}
}

// lockParent serialises the snapshot phase (pause .. checkpoint .. resume) of
// one container across processes and clients of this node: the node's lock
// node.ParentLock(ns, id), released by unlock or by the holder's death. It
// waits for ctx.
func (c *Client) lockParent(ctx context.Context, ns, id string) (unlock func(), err error) {
	unlock, _, err = c.node.Lock(ctx, node.ParentLock(ns, id), true)
	if err != nil {
		return nil, fmt.Errorf("wait for another fork of %s to finish its snapshot: %w", id, err)
	}
	return unlock, nil
}

// tryLockParent is lockParent without waiting; ok is false if another
// holds the lock.
func (c *Client) tryLockParent(ctx context.Context, ns, id string) (unlock func(), ok bool, err error) {
	unlock, ok, err = c.node.Lock(ctx, node.ParentLock(ns, id), false)
	if err != nil {
		return nil, false, fmt.Errorf("lock of %s: %w", id, err)
	}
	return unlock, ok, nil
}

// Failpoint stages of a fork (LAZYFORK_FAILPOINT=<stage>[:sleep=DUR|:exit]),
// for fault-injection tests.
const (
	FailAfterPause     = "after-pause"
	FailAfterFreeze    = "after-freeze"
	FailAfterCheckpt   = "after-checkpoint"
	FailAfterFirstFork = "after-first-fork-created"
	FailBeforeResume   = "before-resume"
)

// failpointOut is where failpoints announce themselves.
var failpointOut io.Writer = os.Stderr

// failpoint acts on LAZYFORK_FAILPOINT when it names stage: with sleep=DUR it
// prints "lazyfork: failpoint STAGE" on stderr and sleeps (ctx ends the sleep
// early, with ctx's error), with exit it prints the same and exits at once,
// as a crash would (status 3). Otherwise it does nothing.
func failpoint(ctx context.Context, stage string) error {
	v := os.Getenv("LAZYFORK_FAILPOINT")
	if v == "" {
		return nil
	}
	name, action, _ := strings.Cut(v, ":")
	if name != stage {
		return nil
	}
	fmt.Fprintf(failpointOut, "lazyfork: failpoint %s\n", stage)
	switch {
	case action == "exit":
		os.Exit(3)
	case strings.HasPrefix(action, "sleep="):
		d, err := time.ParseDuration(strings.TrimPrefix(action, "sleep="))
		if err != nil {
			return fmt.Errorf("LAZYFORK_FAILPOINT=%s: %w", v, errdefs.ErrInvalidArgument)
		}
		select {
		case <-time.After(d):
		case <-ctx.Done():
			return ctx.Err()
		}
	}
	return nil
}
