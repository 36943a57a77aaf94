package client

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"maps"
	"net"
	"time"

	"github.com/containerd/containerd/v2/core/snapshots"
	"github.com/containerd/errdefs"
	"github.com/containerd/ttrpc"

	lazyforkv1 "github.com/lazyfork/lazyfork/proto/lazyfork/v1"
)

const (
	// FreezeSourceLabel on a Prepare names the active snapshot whose upper
	// dir the new snapshot's layer copies (the backend acts on it).
	FreezeSourceLabel = "containerd.io/snapshot/lazyfork.freeze-source"
	// FrozenFromLabel marks a committed frozen layer with the key it froze.
	FrozenFromLabel = "containerd.io/snapshot/lazyfork.frozen-from"
	// DefaultAddress is where lazyfork-snapshotter serves containerd's
	// snapshot gRPC API; its ttrpc API is at TTRPCAddress(DefaultAddress).
	DefaultAddress = "/run/lazyfork/snapshotter.sock"
	// SnapshotterName is the proxy plugin name containerd knows it by.
	SnapshotterName = "lazyfork"
)

// TTRPCAddress is the ttrpc socket next to the gRPC socket address.
func TTRPCAddress(address string) string { return address + ".ttrpc" }

// Freeze captures the upper dir of the active snapshot activeKey into the
// committed snapshot frozenName, whose parent is activeKey's parent. Forks
// then Prepare(forkKey, frozenName). The caller guarantees that nothing
// writes to activeKey's upper dir meanwhile (the task is frozen); to keep
// that pause short, use StartFreeze before pausing and Commit after.
// opts set the frozen layer's labels (FrozenFromLabel is added).
// On error nothing is left behind.
func Freeze(ctx context.Context, sn snapshots.Snapshotter, activeKey, frozenName string, opts ...snapshots.Opt) (snapshots.Info, error) {
	p, err := StartFreeze(ctx, sn, activeKey, frozenName, opts...)
	if err != nil {
		return snapshots.Info{}, err
	}
	return p.Commit(ctx)
}

// PendingFreeze is a freeze whose bulk copy is done; Commit finishes it.
type PendingFreeze struct {
	sn         snapshots.Snapshotter
	activeKey  string
	frozenName string
	tmp        string
	labels     map[string]string
}

// StartFreeze does the bulk of a freeze while the task still runs: the
// snapshotter copies activeKey's upper dir as it is. Then pause the task,
// call Commit (it copies only what changed since StartFreeze), and resume.
// Call Commit or Abort.
func StartFreeze(ctx context.Context, sn snapshots.Snapshotter, activeKey, frozenName string, opts ...snapshots.Opt) (*PendingFreeze, error) {
	info, err := sn.Stat(ctx, activeKey)
	if err != nil {
		return nil, fmt.Errorf("freeze %q: %w", activeKey, err)
	}
	if info.Kind != snapshots.KindActive {
		return nil, fmt.Errorf("freeze %q: it is %v, not active: %w", activeKey, info.Kind, errdefs.ErrInvalidArgument)
	}
	if frozenName == "" {
		return nil, fmt.Errorf("freeze %q: empty frozen layer name: %w", activeKey, errdefs.ErrInvalidArgument)
	}
	var base snapshots.Info
	for _, o := range opts {
		if err := o(&base); err != nil {
			return nil, err
		}
	}
	labels := maps.Clone(base.Labels)
	if labels == nil {
		labels = map[string]string{}
	}
	labels[FrozenFromLabel] = activeKey
	p := &PendingFreeze{sn: sn, activeKey: activeKey, frozenName: frozenName,
		tmp: frozenName + "-freezing-" + randomSuffix(), labels: labels}
	if _, err := sn.Prepare(ctx, p.tmp, info.Parent, snapshots.WithLabels(map[string]string{FreezeSourceLabel: activeKey})); err != nil {
		return nil, fmt.Errorf("freeze %q: %w", activeKey, err)
	}
	return p, nil
}

// Commit brings the copy up to date with the (now frozen) upper dir and
// commits it as the frozen layer.
func (p *PendingFreeze) Commit(ctx context.Context) (snapshots.Info, error) {
	if err := p.sn.Commit(ctx, p.frozenName, p.tmp, snapshots.WithLabels(p.labels)); err != nil {
		if aerr := p.Abort(ctx); aerr != nil {
			err = errors.Join(err, aerr)
		}
		return snapshots.Info{}, fmt.Errorf("freeze %q as %q: %w", p.activeKey, p.frozenName, err)
	}
	return p.sn.Stat(ctx, p.frozenName)
}

// Abort drops the copy.
func (p *PendingFreeze) Abort(ctx context.Context) error {
	// A fresh context: the caller's may be what failed.
	rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 30*time.Second)
	defer cancel()
	if err := p.sn.Remove(rctx, p.tmp); err != nil && !errdefs.IsNotFound(err) {
		return fmt.Errorf("remove %q: %w", p.tmp, err)
	}
	return nil
}

func randomSuffix() string {
	b := make([]byte, 6)
	_, _ = rand.Read(b)
	return hex.EncodeToString(b)
}

// Client talks to the snapshotter's ttrpc API.
type Client struct {
	lazyforkv1.SnapshotterService
	c *ttrpc.Client
}

// Dial connects to the ttrpc socket (TTRPCAddress of the snapshotter's address).
func Dial(ctx context.Context, ttrpcAddress string) (*Client, error) {
	var d net.Dialer
	conn, err := d.DialContext(ctx, "unix", ttrpcAddress)
	if err != nil {
		return nil, fmt.Errorf("dial lazyfork-snapshotter at %s: %w", ttrpcAddress, errdefs.ErrUnavailable)
	}
	c := ttrpc.NewClient(conn)
	return &Client{SnapshotterService: lazyforkv1.NewSnapshotterClient(c), c: c}, nil
}

// Close closes the connection.
func (c *Client) Close() error { return c.c.Close() }
