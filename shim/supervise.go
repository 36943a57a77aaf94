package shim

import (
	"context"
	"fmt"
	"sync"

	"github.com/containerd/log"
	"golang.org/x/sys/unix"

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

// isAttached reports whether the supervisor traces its task now.
func (v *supervisor) isAttached() bool {
	if v == nil {
		return false
	}
	v.mu.Lock()
	defer v.mu.Unlock()
	return v.attached
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

// hold stops every thread of the attached task under the supervisor's
// ptrace and keeps it stopped, so that the task can be frozen without
// running a guarded call untraced; release (after the freeze) or unhold
// (the freeze failed) follows. It reports whether it held anything.
func (v *supervisor) hold() (bool, error) {
	if v == nil {
		return false, nil
	}
	v.mu.Lock()
	defer v.mu.Unlock()
	if !v.attached {
		return false, nil
	}
	if err := v.remote.Hold(); err != nil {
		return false, fmt.Errorf("madvise supervisor of %s: hold: %w", v.id, err)
	}
	return true, nil
}

// release detaches from the held (now frozen) task: its threads go from
// their stops into the freezer.
func (v *supervisor) release() error {
	v.mu.Lock()
	defer v.mu.Unlock()
	if err := v.remote.Release(); err != nil {
		return fmt.Errorf("madvise supervisor of %s: release: %w", v.id, err)
	}
	v.attached = false
	return nil
}

// unhold lets the held task run on, traced.
func (v *supervisor) unhold(ctx context.Context) {
	v.mu.Lock()
	defer v.mu.Unlock()
	if err := v.remote.Unhold(); err != nil {
		log.G(ctx).WithError(err).WithField("id", v.id).Warn("lazyfork: madvise supervisor: unhold")
	}
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

// readZeroGuard reports whether the snapshot in dir carries a zero-mode guard.
func readZeroGuard(dir string) (bool, error) {
	ths, err := madvguard.Inspect(dir)
	if err != nil {
		return false, err
	}
	for _, th := range ths {
		if th.Guards > 0 && th.Mode == madvguard.Zero {
			return true, nil
		}
	}
	return false, nil
}

// zeroGuards remembers, per snapshot image, whether it carries a zero-mode
// guard: every fork of a snapshot asks twice (its CRIU configuration, its
// supervisor), and reading the guard decodes the image's core files (2 ms a
// fork, 13% of a group shim's CPU in a batch of 100). A snapshot's image does
// not change once committed; a directory replaced in place (the rewrite's
// staged commit exchanges it) or made anew under a freed inode number is
// another (inode, change time) pair. Only answers read without error are kept.
type zeroGuards struct{ m sync.Map }

type imageKey struct {
	dir            string
	dev, ino       uint64
	ctimeS, ctimeN int64
}

func (z *zeroGuards) of(ctx context.Context, dir string) bool {
	var st unix.Stat_t
	if err := unix.Stat(dir, &st); err != nil {
		log.G(ctx).WithError(err).Warn("lazyfork: inspect madvise guard")
		return false
	}
	k := imageKey{dir, uint64(st.Dev), st.Ino, st.Ctim.Sec, st.Ctim.Nsec}
	if v, ok := z.m.Load(k); ok {
		return v.(bool)
	}
	v, err := readZeroGuard(dir)
	if err != nil {
		log.G(ctx).WithError(err).Warn("lazyfork: inspect madvise guard")
		return false
	}
	z.m.Store(k, v)
	return v
}

// superviseIfZero attaches a madvise supervisor to a task restored from a
// snapshot whose guard is in zero mode: guarded purges then become fresh
// anonymous mappings (memory given back, reads as zeros). The restore left
// such a task frozen (freezeOnResumeScript): the supervisor seizes it
// frozen and only then is it thawed, so its first guarded call is traced
// too.
func (s *Service) superviseIfZero(ctx context.Context, id string, c *container, pid int) {
	if !s.zeroGuards.of(ctx, c.state.Snapshot) {
		return
	}
	defer thawRestored(ctx, id, pid)
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

// freezeOnResumeScript is the CRIU action script of a restore whose snapshot
// carries a zero-mode guard. At CRIU's pre-resume stage the restored tasks
// are still in CRIU's ptrace stops; it freezes their cgroup there (stopped
// threads count as frozen), so that when CRIU detaches each thread goes into
// the freezer instead of running: no guarded call runs before the shim's
// supervisor has seized the frozen task (superviseIfZero thaws it then).
// runc put CRIU itself into the container's cgroup: CRIU and the script move
// to the cgroup of CRIU's parent (runc) first. Any failure leaves the task
// running, as before (its first guarded calls may then fail with ENOSYS).
const freezeOnResumeScript = `#!/bin/sh
# LazyFork: a fork with a zero-mode madvise guard stays frozen at the end of
# its restore until the shim's madvise supervisor has attached.
[ "$CRTOOLS_SCRIPT_ACTION" = pre-resume ] || exit 0
task=$CRTOOLS_INIT_PID
criu=$PPID
[ -n "$task" ] || exit 0
runc=$(sed -n 's/^PPid:[[:space:]]*//p' /proc/$criu/status)
if [ -e /sys/fs/cgroup/cgroup.controllers ]; then
	cg=$(sed -n 's/^0:://p' /proc/$task/cgroup)
	back=$(sed -n 's/^0:://p' /proc/$runc/cgroup)
	[ -n "$cg" ] && [ "$cg" != "$back" ] || exit 0
	echo $criu > "/sys/fs/cgroup$back/cgroup.procs" || exit 0
	echo $$ > "/sys/fs/cgroup$back/cgroup.procs" || exit 0
	echo 1 > "/sys/fs/cgroup$cg/cgroup.freeze"
else
	fz='s/^[0-9]*:\([^:]*,\)\{0,1\}freezer\(,[^:]*\)\{0,1\}://p'
	cg=$(sed -n "$fz" /proc/$task/cgroup)
	back=$(sed -n "$fz" /proc/$runc/cgroup)
	[ -n "$cg" ] && [ "$cg" != "$back" ] || exit 0
	echo $criu > "/sys/fs/cgroup/freezer$back/cgroup.procs" || exit 0
	echo $$ > "/sys/fs/cgroup/freezer$back/cgroup.procs" || exit 0
	echo FROZEN > "/sys/fs/cgroup/freezer$cg/freezer.state"
fi
exit 0
`

// thawRestored thaws the cgroup of a restored task that freezeOnResumeScript
// froze (a no-op for a running one).
func thawRestored(ctx context.Context, id string, pid int) {
	cg, err := loadCgroup(pid)
	if err == nil {
		switch g := cg.(type) {
		case interface{ Thaw() error }:
			err = g.Thaw()
		default:
			err = fmt.Errorf("cgroup %T cannot thaw", cg)
		}
	}
	if err != nil {
		log.G(ctx).WithError(err).WithField("id", id).Error("lazyfork: thaw restored task")
	}
}
