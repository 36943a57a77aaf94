//go:build !linux

package node

import (
	"context"
	"fmt"
	"runtime"

	"github.com/containerd/errdefs"

	"github.com/lazyfork/lazyfork/api"
)

// Local works on a LazyFork root's files, which exist only on a Linux node.
// Here (a client on another OS, such as a Mac driving a Lima VM) every call
// fails: reach the node through its API (NewRemote) instead.
type Local struct{ root string }

// NewLocal returns a Local whose every call fails on this OS.
func NewLocal(root string) *Local { return &Local{root: root} }

func (l *Local) err() error {
	return fmt.Errorf("LazyFork's root %s is a Linux node's directory: on %s reach the node through its API (--api, $LAZYFORK_API; lazyfork vm start): %w",
		l.root, runtime.GOOS, errdefs.ErrNotImplemented)
}

func (l *Local) PrepareSnapshot(context.Context, string) (string, string, error) {
	return "", "", l.err()
}
func (l *Local) KeepSnapshot(context.Context, string) error                     { return l.err() }
func (l *Local) RemoveSnapshot(context.Context, string) error                   { return l.err() }
func (l *Local) SetRootfs(context.Context, string, *api.RootfsRecord) error     { return l.err() }
func (l *Local) ReleaseRootfs(context.Context, string) error                    { return l.err() }
func (l *Local) Snapshot(context.Context, string) (*Snapshot, error)            { return nil, l.err() }
func (l *Local) SnapshotDirs(context.Context) ([]SnapshotDir, error)            { return nil, l.err() }
func (l *Local) Families(context.Context) ([]Family, error)                     { return nil, l.err() }
func (l *Local) FreeSpace(context.Context) (Space, error)                       { return Space{}, l.err() }
func (l *Local) CollectMemory(context.Context) ([]string, error)                { return nil, l.err() }
func (l *Local) SaveOp(context.Context, *api.OpRecord) error                    { return l.err() }
func (l *Local) RemoveOp(context.Context, string) error                         { return l.err() }
func (l *Local) Ops(context.Context) ([]OpState, error)                         { return nil, l.err() }
func (l *Local) RemoveLock(context.Context, string) (bool, error)               { return false, l.err() }
func (l *Local) SaveRestoreLog(context.Context, string, string) (string, error) { return "", l.err() }
func (l *Local) PrepareLog(context.Context, string) error                       { return l.err() }
func (l *Local) RemoveLog(context.Context, string) error                        { return l.err() }
func (l *Local) LogFiles(context.Context, string) ([]string, error)             { return nil, l.err() }
func (l *Local) StatLog(context.Context, string) (bool, bool, error)            { return false, false, l.err() }
func (l *Local) ReadLog(context.Context, string, bool) (LogReader, error)       { return nil, l.err() }
func (l *Local) Close() error                                                   { return nil }

func (l *Local) Lock(context.Context, string, bool) (func(), bool, error) {
	return nil, false, l.err()
}

func (l *Local) SweepLocks(context.Context, []string, bool) ([]string, error) {
	return nil, l.err()
}

func (l *Local) Usage(context.Context, uint32, string) (Usage, error) {
	return Usage{}, l.err()
}

var _ Node = (*Local)(nil)
