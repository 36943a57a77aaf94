package shim

import (
	"context"
	"time"

	taskAPI "github.com/containerd/containerd/api/runtime/task/v3"
	tasktypes "github.com/containerd/containerd/api/types/task"
	ptypes "github.com/containerd/containerd/v2/pkg/protobuf/types"
	"github.com/containerd/errdefs/pkg/errgrpc"
	"github.com/containerd/log"

	"github.com/lazyfork/lazyfork/api"
)

// Pause freezes a task with runc's shim. A supervised task is held in its
// supervisor's ptrace stops while it freezes, then let go: its threads go
// from those stops into the freezer, and none runs a guarded call untraced
// (madvguard.Supervisor.Hold).
//
// A checkpoint follows a pause (containerd's and LazyFork's clients pause
// first): when the task's moves fragmented its heap enough, the copy that
// consolidates it is made here, before the freeze, while the task runs,
// and the checkpoint maps it. The call that consolidates then frees the old
// pieces itself (when nothing else maps them) instead of leaving a copy of
// the heap until the next one. (A pause no checkpoint follows, such as
// `ctr task pause`, leaves the copy unused for preparedTTL; a pause is only
// ever late by a copy once per consolidateAfter patches.) The snapshot
// records how long the freeze lasted (api.SnapshotSource.Paused), so that
// the pause reported is the freeze's, not the copy's.
func (s *Service) Pause(ctx context.Context, r *taskAPI.PauseRequest) (*ptypes.Empty, error) {
	defer s.trim.begin()() // a checkpoint follows: no tight memory limit now
	warmForMove(ctx)       // and its move's helper joins the task's memory cgroup
	if st, err := s.stateOf(ctx, r.ID); err == nil {
		s.waitPreCopy(st.Namespace + "/" + st.ID)
		ts, err := s.TTRPCTaskService.State(ctx, &taskAPI.StateRequest{ID: r.ID})
		running := err == nil && ts.Status == tasktypes.Status_RUNNING
		if due, bound := s.consolidationDue(st); due && running {
			s.prepareConsolidation(ctx, st, bound)
		}
		if running && s.movesAtCheckpoint(st) {
			s.startStandbyHelper(ctx)
			if hop := peekPrepared(st.Namespace + "/" + st.ID); hop != nil {
				preloadStandbyHelper(hop)
			}
		}
	}
	return s.pause(ctx, r)
}

// Update takes a client's snapshot intent (lazyforkv1.SnapshotIntent: how
// many forks the snapshot its next Pause begins is for, and whether that
// Pause freezes the task in the shim: inplace.go) and touches nothing of the
// task; any other update (resources, from ctr, nerdctl or CRI) is runc's.
func (s *Service) Update(ctx context.Context, r *taskAPI.UpdateTaskRequest) (*ptypes.Empty, error) {
	in, ok, err := api.SnapshotIntentOf(r.Resources)
	if !ok {
		return s.TTRPCTaskService.Update(ctx, r)
	}
	if err != nil {
		return nil, errgrpc.ToGRPC(err)
	}
	st, err := s.stateOf(ctx, r.ID)
	if err != nil {
		return nil, errgrpc.ToGRPC(err)
	}
	noteIntent(st.Namespace+"/"+st.ID, int(in.GetForks()))
	// A snapshot follows: its move's helper starts now (standbyHelper).
	if s.movesAtCheckpoint(st) {
		s.startStandbyHelper(ctx)
		s.startPreCopy(ctx, st)
	}
	if in.GetFreezeInShim() {
		s.noteFreezeIntent(r.ID)
	}
	return &ptypes.Empty{}, nil
}

// pause freezes a task (Pause without the consolidation, for the shim's own
// pauses).
func (s *Service) pause(ctx context.Context, r *taskAPI.PauseRequest) (*ptypes.Empty, error) {
	s.mu.Lock()
	delete(s.thawed, r.ID)
	delete(s.frozenAt, r.ID)
	inShim := s.takeFreezeIntent(r.ID)
	s.mu.Unlock()
	freezing := time.Now() // monotonic: the pause is measured on this clock
	sup := s.supervisorOf(r.ID)
	held, err := sup.hold()
	if err != nil {
		return nil, errgrpc.ToGRPC(err)
	}
	resp, frozeHere := &ptypes.Empty{}, false
	if inShim {
		// The freeze starts here, not after a runc start.
		freezing = time.Now()
		frozeHere, err = s.freezeInShim(ctx, r.ID)
	}
	if !frozeHere && err == nil {
		resp, err = s.TTRPCTaskService.Pause(ctx, r)
	}
	if err == nil {
		s.mu.Lock()
		s.frozenAt[r.ID] = freezing
		s.mu.Unlock()
	}
	if held {
		if err != nil {
			sup.unhold(ctx)
		} else if rerr := sup.release(); rerr != nil {
			if frozeHere {
				s.thawInShim(ctx, r.ID)
			}
			return nil, errgrpc.ToGRPC(rerr)
		}
	}
	if err != nil {
		return nil, errgrpc.ToGRPC(err)
	}
	return resp, nil
}

// Resume thaws a task with runc's shim, its supervisor attached again first,
// or itself if its Pause froze it in the shim (inplace.go). The Resume that
// follows a checkpoint which already thawed the task (thawBeforeRewrite) has
// nothing left to do.
func (s *Service) Resume(ctx context.Context, r *taskAPI.ResumeRequest) (*ptypes.Empty, error) {
	s.mu.Lock()
	done := s.thawed[r.ID]
	delete(s.thawed, r.ID)
	delete(s.frozenAt, r.ID)
	s.mu.Unlock()
	if done {
		return &ptypes.Empty{}, nil
	}
	// The supervisor seizes the frozen task before the thaw, so that its
	// first guarded call is traced.
	s.supervisorOf(r.ID).attach(ctx)
	if handled, err := s.thawInShim(ctx, r.ID); handled {
		if err != nil {
			return nil, errgrpc.ToGRPC(err)
		}
		return &ptypes.Empty{}, nil
	}
	return s.TTRPCTaskService.Resume(ctx, r)
}

// thawBeforeRewrite thaws a paused task right after its dump when whoever
// paused it asked for it (lazyforkv1.CheckpointOptions.ThawAfterDump): the
// rewrite, most of a snapshot's time, then runs while the task does. It
// returns when the task was thawed, recorded in the snapshot's source
// (api.SnapshotSource.Thawed); zero if it was not. Any failure leaves the
// task paused for the asker's own Resume.
func (s *Service) thawBeforeRewrite(ctx context.Context, id string) time.Time {
	if _, err := s.Resume(ctx, &taskAPI.ResumeRequest{ID: id}); err != nil {
		log.G(ctx).WithError(err).WithField("id", id).Warn("lazyfork: thaw before rewrite")
		return time.Time{}
	}
	thawedAt := time.Now() // monotonic, as Pause's
	s.mu.Lock()
	s.thawed[id] = true
	s.mu.Unlock()
	return thawedAt
}
