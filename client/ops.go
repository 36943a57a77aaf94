package client

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/containerd/errdefs"
	"golang.org/x/sys/unix"

	"github.com/lazyfork/lazyfork/api"
	"github.com/lazyfork/lazyfork/internal/atomicfile"
	"github.com/lazyfork/lazyfork/internal/procfs"
)

// opMarker is a file in a snapshot directory naming the operation that made
// it, while that operation runs; a kept snapshot loses it when its operation
// succeeds. A directory holding it whose operation is over is an orphan.
const opMarker = "op"

// opRecord is the intent journal of one Fork call, ROOT/ops/<ID>.json: what
// it may have made, so that whoever finds it after the call's process died
// (Reconcile) can undo it. It is written before the parent is paused and
// updated as resources appear; it goes when the call has ended, cleanly.
type opRecord struct {
	ID        string `json:"id"`
	Namespace string `json:"namespace"`
	Parent    string `json:"parent"`
	// PID and PIDStart (field 22 of /proc/PID/stat) identify the process
	// running the call; a reused PID has another start time.
	PID      int    `json:"pid"`
	PIDStart string `json:"pidStart"`
	// Paused: this call paused (or was about to pause) the parent; a dead
	// call's parent is thawed if it is still paused.
	Paused bool `json:"paused,omitempty"`
	// SnapshotDir is ROOT/snapshots/<x>, the snapshot's directory.
	SnapshotDir string `json:"snapshotDir,omitempty"`
	// ImageDir is the image directory the forks restore from (their
	// api.LabelSnapshot): in SnapshotDir, or a kept snapshot's.
	ImageDir string `json:"imageDir,omitempty"`
	// Snapshotter holds the parent's rootfs, Frozen the frozen layer of its
	// writable layer, and the forks' rootfs snapshots (named as the forks).
	Snapshotter string `json:"snapshotter,omitempty"`
	Frozen      string `json:"frozen,omitempty"`
	// Lease is the containerd lease the call's resources are made under.
	Lease   string    `json:"lease,omitempty"`
	Forks   []string  `json:"forks,omitempty"`
	Created time.Time `json:"created"`
}

func (c *Client) opsDir() string   { return api.Root(c.root).Ops() }
func (c *Client) locksDir() string { return api.Root(c.root).Locks() }

func (c *Client) opPath(id string) string { return filepath.Join(c.opsDir(), id+".json") }

// op is a running operation: its record, saved on every change.
type op struct {
	c   *Client
	mu  sync.Mutex
	rec opRecord
}

// newOp writes the record of a new operation on parent in namespace ns.
func (c *Client) newOp(ns, parent string) (*op, error) {
	if err := os.MkdirAll(c.opsDir(), 0o700); err != nil {
		return nil, fmt.Errorf("operation record: %w", err)
	}
	o := &op{c: c, rec: opRecord{
		ID: randomHex(8), Namespace: ns, Parent: parent,
		PID: os.Getpid(), PIDStart: processStart(os.Getpid()), Created: time.Now().UTC(),
	}}
	return o, o.save()
}

// update changes the record and saves it.
func (o *op) update(f func(r *opRecord)) error {
	o.mu.Lock()
	defer o.mu.Unlock()
	f(&o.rec)
	return o.saveLocked()
}

func (o *op) save() error {
	o.mu.Lock()
	defer o.mu.Unlock()
	return o.saveLocked()
}

func (o *op) saveLocked() error {
	b, err := json.Marshal(&o.rec)
	if err != nil {
		return err
	}
	if err := atomicfile.WriteFile(o.c.opPath(o.rec.ID), b, 0o600); err != nil {
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
func (o *op) done() error {
	if err := os.Remove(o.c.opPath(o.rec.ID)); err != nil && !errors.Is(err, os.ErrNotExist) {
		return err
	}
	return nil
}

func readOp(path string) (*opRecord, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return nil, err
	}
	var r opRecord
	if err := json.Unmarshal(b, &r); err != nil || r.ID == "" {
		return nil, fmt.Errorf("operation record %s: %w", path, errdefs.ErrDataLoss)
	}
	return &r, nil
}

// alive reports whether the process that wrote r still runs.
func (r *opRecord) alive() bool {
	return r.PID > 0 && r.PIDStart != "" && processStart(r.PID) == r.PIDStart
}

// processStart is the start time of process pid (clock ticks after boot) as
// text, "" if there is no such process.
func processStart(pid int) string {
	st, err := procfs.ReadStat(pid)
	if err != nil {
		return ""
	}
	return strconv.FormatUint(st.StartTime, 10)
}

// lockParent serialises the snapshot phase (pause .. checkpoint .. resume) of
// one container across processes on this host: an flock on
// ROOT/locks/<sha256 of ns/id>.lock, released by unlock or by the process's
// death. It waits for ctx.
func (c *Client) lockParent(ctx context.Context, ns, id string) (unlock func(), err error) {
	for {
		unlock, ok, err := c.tryLockParent(ns, id)
		if err != nil || ok {
			return unlock, err
		}
		select {
		case <-ctx.Done():
			return nil, fmt.Errorf("wait for another fork of %s to finish its snapshot: %w", id, ctx.Err())
		case <-time.After(20 * time.Millisecond):
		}
	}
}

// tryLockParent is lockParent without waiting; ok is false if another
// process holds the lock.
func (c *Client) tryLockParent(ns, id string) (unlock func(), ok bool, err error) {
	if err := os.MkdirAll(c.locksDir(), 0o700); err != nil {
		return nil, false, fmt.Errorf("lock of %s: %w", id, err)
	}
	f, ok, err := tryLockFile(c.lockPath(ns, id))
	if err != nil {
		return nil, false, fmt.Errorf("lock of %s: %w", id, err)
	}
	if !ok {
		return nil, false, nil
	}
	return func() { f.Close() }, true, nil
}

func (c *Client) lockPath(ns, id string) string {
	sum := sha256.Sum256([]byte(ns + "/" + id))
	return filepath.Join(c.locksDir(), hex.EncodeToString(sum[:16])+".lock")
}

// tryLockFile takes an exclusive flock on the file at p (created if
// missing) without waiting. The lock holds only if p still names the locked
// file once it is taken: a remover (removeLockFile) unlinks p under the lock,
// and whoever had opened the unlinked file retries on the new one.
func tryLockFile(p string) (_ *os.File, ok bool, _ error) {
	for {
		f, err := os.OpenFile(p, os.O_CREATE|os.O_RDWR|unix.O_CLOEXEC, 0o600)
		if err != nil {
			return nil, false, err
		}
		if err := unix.Flock(int(f.Fd()), unix.LOCK_EX|unix.LOCK_NB); err != nil {
			f.Close()
			if errors.Is(err, unix.EWOULDBLOCK) || errors.Is(err, unix.EINTR) {
				return nil, false, nil
			}
			return nil, false, err
		}
		var held, named unix.Stat_t
		if unix.Fstat(int(f.Fd()), &held) == nil && unix.Stat(p, &named) == nil && held.Ino == named.Ino && held.Dev == named.Dev {
			return f, true, nil
		}
		f.Close() // removed meanwhile: lock the file that p names now
	}
}

// removeLockFile unlinks the lock file p if no process holds it: a deleted
// container's lock goes with it, so ROOT/locks does not grow with every
// container ever forked. It reports whether p is gone.
func removeLockFile(p string) bool {
	f, ok, err := tryLockFile(p)
	if err != nil || !ok {
		return errors.Is(err, os.ErrNotExist)
	}
	defer f.Close()
	return os.Remove(p) == nil
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
