package shim

import (
	"context"
	"fmt"
	"sync"

	"github.com/containerd/log"

	"github.com/lazyfork/lazyfork/memfile/madvguard"
)

// supervisor is the madvise supervisor of one restored task (zero mode): a
// helper process (this binary re-executed, see madvguard.MaybeServe) that
// ptraces the task's tree. CRIU cannot dump a traced task, and a frozen task
// cannot be detached from (its threads never reach the ptrace stop a detach
// needs), so it lets go before the task is paused or dumped and attaches
// again once the task runs. A nil *supervisor does nothing.
type supervisor struct {
	id string

	mu       sync.Mutex // serialises the helper's commands; guards attached
	remote   *madvguard.Remote
	attached bool
}

// detach lets go of the task if attached; it reports whether it did.
func (v *supervisor) detach() (bool, error) {
	if v == nil {
		return false, nil
	}
	v.mu.Lock()
	defer v.mu.Unlock()
	if !v.attached {
		return false, nil
	}
	if err := v.remote.Detach(); err != nil {
		return false, fmt.Errorf("madvise supervisor of %s: detach: %w", v.id, err)
	}
	v.attached = false
	return true, nil
}

// attach traces the task again if it is not traced. A failure is logged: the
// guarded calls then fail with ENOSYS, which allocators take as a refusal.
func (v *supervisor) attach(ctx context.Context) {
	if v == nil {
		return
	}
	v.mu.Lock()
	defer v.mu.Unlock()
	if v.attached {
		return
	}
	if err := v.remote.Attach(); err != nil {
		log.G(ctx).WithError(err).WithField("id", v.id).Warn("lazyfork: madvise supervisor: attach (guarded calls fail with ENOSYS until it does)")
		return
	}
	v.attached = true
}

func (v *supervisor) close(ctx context.Context) {
	if v == nil {
		return
	}
	v.mu.Lock()
	defer v.mu.Unlock()
	if err := v.remote.Close(); err != nil {
		log.G(ctx).WithError(err).WithField("id", v.id).Debug("lazyfork: madvise supervisor close")
	}
	v.attached = false
}

// superviseIfZero attaches a madvise supervisor to a task restored from a
// snapshot whose guard is in zero mode: guarded purges then become fresh
// anonymous mappings (memory given back, reads as zeros).
func (s *Service) superviseIfZero(ctx context.Context, id string, c *container, pid int) {
	ths, err := madvguard.Inspect(c.state.Snapshot)
	if err != nil {
		log.G(ctx).WithError(err).Warn("lazyfork: inspect madvise guard")
		return
	}
	zero := false
	for _, th := range ths {
		zero = zero || th.Guards > 0 && th.Mode == madvguard.Zero
	}
	if !zero {
		return
	}
	remote, err := madvguard.SpawnSupervisor(pid)
	if err != nil {
		log.G(ctx).WithError(err).Warn("lazyfork: madvise supervisor (guarded calls fail with ENOSYS instead)")
		return
	}
	s.mu.Lock()
	c.sup = &supervisor{id: id, remote: remote, attached: true}
	s.mu.Unlock()
}

// supervisorOf returns the supervisor of task id (nil if none).
func (s *Service) supervisorOf(id string) *supervisor {
	if c := s.get(id); c != nil {
		s.mu.Lock()
		defer s.mu.Unlock()
		return c.sup
	}
	return nil
}
