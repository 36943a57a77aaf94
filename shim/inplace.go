package shim

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"time"

	eventstypes "github.com/containerd/containerd/api/events"
	taskAPI "github.com/containerd/containerd/api/runtime/task/v3"
	tasktypes "github.com/containerd/containerd/api/types/task"
	"github.com/containerd/containerd/v2/core/events"
	"github.com/containerd/containerd/v2/core/runtime"
	ptypes "github.com/containerd/containerd/v2/pkg/protobuf/types"
	"github.com/containerd/errdefs"
	"github.com/containerd/errdefs/pkg/errgrpc"
	"github.com/containerd/log"

	"github.com/lazyfork/lazyfork/internal/freezer"
)

// A snapshot's pause freezes the task in the shim when its client asks
// (lazyforkv1.SnapshotIntent.freeze_in_shim, told before the Pause):
// `runc pause` and `runc resume` only write the cgroup's freezer after a Go
// program's start, 15-20 ms each on a slow host, and the second of them is
// inside the freeze. runc derives a container's paused state from its
// freezer, so runc agrees with the shim's freeze (its kill thaws a frozen
// container for SIGKILL; its pause and resume refuse it while frozen).
// Everyone else sees what runc's pause shows: the shim's State reports the
// task PAUSED (runc's shim, which never paused it, would say RUNNING), and
// the shim publishes the paused and resumed events. A user's pause (ctr,
// nerdctl, CRI) asks nothing and is runc's.

// freezeCgroup freezes a cgroup (v1 freezer or v2) and waits until it is.
func freezeCgroup(dir string) error { return freezer.Set(dir, true) }

// noteFreezeIntent records that the task's next Pause is a snapshot's that
// its client ends itself.
func (s *Service) noteFreezeIntent(id string) {
	s.mu.Lock()
	s.freezeIntents[id] = time.Now()
	s.mu.Unlock()
}

// takeFreezeIntent reports (and forgets) whether a client asked, within
// intentTTL, that the task's next Pause freeze it in the shim. Called with
// mu held.
func (s *Service) takeFreezeIntent(id string) bool {
	at, ok := s.freezeIntents[id]
	delete(s.freezeIntents, id)
	return ok && time.Since(at) < intentTTL
}

// errFrozenForSnapshot: a Pause of a task this shim holds frozen for a
// snapshot (another snapshot's Pause; runc would refuse it as not running).
var errFrozenForSnapshot = errors.New("frozen for a snapshot already")

// freezeInShim freezes a running task's cgroup itself. ok is false, with
// nothing changed, when it cannot (the task is not running as runc's shim
// sees it, or its cgroup is frozen already, or does not freeze within a
// second: then it is thawed again); the caller then asks runc.
func (s *Service) freezeInShim(ctx context.Context, id string) (ok bool, err error) {
	s.mu.Lock()
	_, held := s.inPlace[id]
	s.mu.Unlock()
	if held {
		return false, fmt.Errorf("pause %s: %w: %w", id, errFrozenForSnapshot, errdefs.ErrFailedPrecondition)
	}
	ts, err := s.TTRPCTaskService.State(ctx, &taskAPI.StateRequest{ID: id})
	if err != nil || ts.Status != tasktypes.Status_RUNNING || ts.Pid == 0 {
		return false, nil
	}
	dir, err := freezerCgroup(int(ts.Pid))
	if err != nil {
		log.G(ctx).WithError(err).WithField("id", id).Warn("lazyfork: the snapshot's pause is runc's: no freezer cgroup")
		return false, nil
	}
	if frozen, err := freezer.State(dir); err != nil || frozen {
		return false, nil
	}
	if err := freezer.Set(dir, true); err != nil {
		log.G(ctx).WithError(err).WithField("id", id).Warn("lazyfork: the snapshot's pause is runc's")
		if terr := freezer.Set(dir, false); terr != nil {
			return false, fmt.Errorf("pause %s: its cgroup neither froze nor thawed: %w", id, errors.Join(err, terr))
		}
		return false, nil
	}
	s.mu.Lock()
	s.inPlace[id] = dir
	s.mu.Unlock()
	log.G(ctx).WithField("id", id).Debug("lazyfork: froze the task for a snapshot in the shim")
	s.publishAsync(ctx, runtime.TaskPausedEventTopic, &eventstypes.TaskPaused{ContainerID: id})
	return true, nil
}

// frozenInShim reports whether this shim holds the task frozen itself.
func (s *Service) frozenInShim(id string) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	_, ok := s.inPlace[id]
	return ok
}

// State is runc's shim's, but PAUSED for a task this shim froze itself: a
// client that dies mid-snapshot leaves it frozen, and lazyfork gc (like
// anyone) resumes a task that says it is paused.
func (s *Service) State(ctx context.Context, r *taskAPI.StateRequest) (*taskAPI.StateResponse, error) {
	resp, err := s.TTRPCTaskService.State(ctx, r)
	if err == nil && r.ExecID == "" && resp.Status == tasktypes.Status_RUNNING && s.frozenInShim(r.ID) {
		resp.Status = tasktypes.Status_PAUSED
	}
	return resp, err
}

// publishAsync publishes an event off the caller's path (the freeze): a
// publish is a call to containerd.
func (s *Service) publishAsync(ctx context.Context, topic string, event events.Event) {
	if s.publisher == nil {
		return
	}
	ctx = context.WithoutCancel(ctx)
	go func() {
		if err := s.publisher.Publish(ctx, topic, event); err != nil {
			log.G(ctx).WithError(err).WithField("topic", topic).Warn("lazyfork: publish event")
		}
	}()
}

// thawInShim thaws a task this shim froze itself; handled is false for any
// other task (runc's to resume). A cgroup gone with its task is thawed.
func (s *Service) thawInShim(ctx context.Context, id string) (handled bool, err error) {
	s.mu.Lock()
	dir, ok := s.inPlace[id]
	delete(s.inPlace, id)
	s.mu.Unlock()
	if !ok {
		return false, nil
	}
	if err := freezer.Set(dir, false); err != nil && !errors.Is(err, fs.ErrNotExist) {
		s.mu.Lock()
		s.inPlace[id] = dir // a Resume may try again
		s.mu.Unlock()
		return true, fmt.Errorf("resume %s: thaw its cgroup: %w", id, err)
	}
	s.publishAsync(ctx, runtime.TaskResumedEventTopic, &eventstypes.TaskResumed{ContainerID: id})
	return true, nil
}

// Exec is runc's shim's, refused while this shim holds the task frozen, as
// runc's shim refuses it for a task it paused: the exec's runc init would
// join the frozen cgroup, where the snapshot's dump would find it.
func (s *Service) Exec(ctx context.Context, r *taskAPI.ExecProcessRequest) (*ptypes.Empty, error) {
	if s.frozenInShim(r.ID) {
		return nil, errgrpc.ToGRPCf(errdefs.ErrFailedPrecondition, "cannot exec in a paused state (%s is frozen for a snapshot)", r.ID)
	}
	return s.TTRPCTaskService.Exec(ctx, r)
}
