package shim

import (
	"context"
	"time"

	taskAPI "github.com/containerd/containerd/api/runtime/task/v3"
	ptypes "github.com/containerd/containerd/v2/pkg/protobuf/types"
	"github.com/containerd/errdefs/pkg/errgrpc"
	"github.com/containerd/log"
)

// Pause freezes a task with runc's shim; a supervised task is let go first.
func (s *Service) Pause(ctx context.Context, r *taskAPI.PauseRequest) (*ptypes.Empty, error) {
	s.mu.Lock()
	delete(s.thawed, r.ID)
	s.mu.Unlock()
	sup := s.supervisorOf(r.ID)
	detached, err := sup.detach()
	if err != nil {
		return nil, errgrpc.ToGRPC(err)
	}
	resp, err := s.TTRPCTaskService.Pause(ctx, r)
	if err != nil && detached {
		sup.attach(ctx)
	}
	return resp, err
}

// Resume thaws a task with runc's shim, then its supervisor attaches again.
// The Resume that follows a checkpoint which already thawed the task
// (thawBeforeRewrite) has nothing left to do.
func (s *Service) Resume(ctx context.Context, r *taskAPI.ResumeRequest) (*ptypes.Empty, error) {
	s.mu.Lock()
	done := s.thawed[r.ID]
	delete(s.thawed, r.ID)
	s.mu.Unlock()
	if done {
		return &ptypes.Empty{}, nil
	}
	resp, err := s.TTRPCTaskService.Resume(ctx, r)
	if err == nil {
		s.supervisorOf(r.ID).attach(ctx)
	}
	return resp, err
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
	thawedAt := time.Now().UTC()
	s.mu.Lock()
	s.thawed[id] = true
	s.mu.Unlock()
	return thawedAt
}
