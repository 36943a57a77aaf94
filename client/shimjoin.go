package client

import (
	"context"
	"fmt"
	"maps"
	"sync"
	"time"

	tasks "github.com/containerd/containerd/api/services/tasks/v1"
	tasktypes "github.com/containerd/containerd/api/types/task"
	"github.com/containerd/containerd/v2/core/sandbox"
	"github.com/containerd/errdefs"
	"github.com/containerd/log"

	"github.com/lazyfork/lazyfork/api"
	"github.com/lazyfork/lazyfork/internal/shimaddr"
)

// containerd runs the shim binary (`containerd-shim-lazyfork-v1 start`) for
// every task it creates, even when the task's shim already serves its group:
// a process start per fork, 10-15 ms of CPU on a slow host. It runs none for
// a task whose container names a sandbox of its sandbox store: it connects the
// task to the shim serving the task whose id is the sandbox's
// (core/runtime/v2 ShimManager.Start reads that task's bootstrap.json). So
// each shim group of a call has a leader: a fork of the group that a call
// before this one restored and whose task runs (a kept snapshot restored
// again), else the group's first fork, which starts the group's shim as ever.
// The client records a sandbox named after the leader, only while the call
// creates its tasks, and the group's other forks name it as their sandbox.
// A join that fails (the leader's shim went) takes the usual path
// (restoreFork). Nothing else reads the record: containerd's task create only
// looks it up, and a later task create of such a fork, the record gone, runs
// the shim binary as for any container (containerd logs that it did not find
// the sandbox). A call that dies leaves the record to Reconcile, which finds
// it by the call's op label (removeOpSandboxes).

// shimJoin is one shim group's leader and what its other forks wait for.
type shimJoin struct {
	leader string
	// ready is closed once the leader's task exists or the leader failed.
	ready chan struct{}
	once  sync.Once
	// sandbox is the sandbox the group's other forks name ("" when they
	// start their shim the usual way); set before ready is closed.
	sandbox string
	// recorded: the leader made the sandbox record (read once the batch's
	// forks are done, to remove it).
	recorded bool
}

// groupSandboxLabel marks a sandbox record that joins a shim group's forks
// to its leader's shim; Reconcile removes only records that carry it.
const groupSandboxLabel = api.LabelShimGroupLeader

// joinable reports whether the forks of a group whose spec carries these
// annotations may join their leader's shim: their shim is the one
// lazyfork.io/shim-group picks (not a CRI pod's or runc's own grouping, which
// the parent's annotations may set), and the runtime is LazyFork's.
func joinable(runtime string, parentAnnotations map[string]string) bool {
	ann := maps.Clone(parentAnnotations)
	if ann == nil {
		ann = map[string]string{}
	}
	ann[api.AnnotationShimGroup] = "probe" // as forkSpec sets it
	group, _ := shimaddr.ShimGroup(ann)
	return runtime == api.RuntimeName && group != ""
}

// openGroupSandbox records the sandbox that joins the forks of a group to the
// shim of its leader's task. Any error leaves the group on the usual path
// (a containerd without the sandbox store).
func (c *Client) openGroupSandbox(ctx context.Context, leader, runtime, op string) bool {
	_, err := c.cd.SandboxStore().Create(ctx, sandbox.Sandbox{
		ID:      leader,
		Labels:  map[string]string{groupSandboxLabel: leader, api.LabelOp: op},
		Runtime: sandbox.RuntimeOpts{Name: runtime},
	})
	if err != nil {
		log.G(ctx).WithError(err).WithField("leader", leader).Debug("lazyfork: shim group on the usual path (no sandbox record)")
		return false
	}
	return true
}

// removeOpSandboxes removes the sandbox records operation op made (a call
// that died before it removed them); returns their ids (dry: would remove).
func (c *Client) removeOpSandboxes(ctx context.Context, op string, dry bool) ([]string, error) {
	store := c.cd.SandboxStore()
	sbs, err := store.List(ctx, fmt.Sprintf("labels.%q==%q", api.LabelOp, op))
	if errdefs.IsNotImplemented(err) {
		return nil, nil // a containerd without a sandbox store
	}
	if err != nil {
		return nil, err
	}
	var removed []string
	for _, sb := range sbs {
		if sb.Labels[groupSandboxLabel] == "" {
			continue // not a join's record: not LazyFork's
		}
		if !dry {
			if err := store.Delete(ctx, sb.ID); err != nil && !errdefs.IsNotFound(err) {
				return removed, err
			}
		}
		removed = append(removed, sb.ID)
	}
	return removed, nil
}

// closeGroupSandboxes removes the records of joins, bounded so a containerd
// that stopped answering does not hold the call (Reconcile removes what
// stays).
func (c *Client) closeGroupSandboxes(ctx context.Context, joins []*shimJoin) {
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 10*time.Second)
	defer cancel()
	for _, j := range joins {
		if j == nil || !j.recorded {
			continue
		}
		// The call's own record: no need to look at it first.
		if err := c.cd.SandboxStore().Delete(ctx, j.leader); err != nil && !errdefs.IsNotFound(err) {
			log.G(ctx).WithError(err).WithField("leader", j.leader).Warn("lazyfork: remove the shim group's sandbox record (lazyfork gc removes it)")
		}
	}
}

// forkJoin is how one fork takes its shim: sandbox names its group leader's
// record (a follower that joins); created, for a leader, tells its group the
// leader's task exists (idempotent).
type forkJoin struct {
	sandbox string
	created func()
}

// shimJoins gives each shim group of ids its join, nil for a group on the
// usual path (every group with cfg.shimJoin off). A group whose shim already
// serves a fork (a call before this one restored the same snapshot) joins
// that fork's shim: it leads, and every fork of this call's group follows. A
// group of this call with more than one fork and no such shim is led by its
// first fork, which starts the group's shim.
func (c *Client) shimJoins(ctx context.Context, ids []string, groupSize int, groupName func(k int) string,
	imageDir, runtime string, parentAnnotations map[string]string, cfg *forkConfig) []*shimJoin {
	joins := make([]*shimJoin, (len(ids)+groupSize-1)/groupSize)
	if !cfg.shimJoin || !joinable(runtime, parentAnnotations) {
		return joins
	}
	for k := range joins {
		// Only a kept snapshot's groups can have forks already.
		if cfg.keptSnapshot {
			if leader := c.groupShimTask(ctx, groupName(k), imageDir); leader != "" {
				j := &shimJoin{leader: leader, ready: make(chan struct{})}
				j.open(ctx, c, runtime, cfg.op)
				j.release(true)
				joins[k] = j
				continue
			}
		}
		if min(len(ids), (k+1)*groupSize)-k*groupSize > 1 {
			joins[k] = &shimJoin{leader: ids[k*groupSize], ready: make(chan struct{})}
		}
	}
	return joins
}

// groupShimTask is a fork of snapshot imageDir in shim group group whose
// task is alive (so its shim serves the group), "" if there is none or
// containerd does not say.
func (c *Client) groupShimTask(ctx context.Context, group, imageDir string) string {
	ctrs, err := c.cd.ContainerService().List(ctx, fmt.Sprintf("labels.%q==%q,labels.%q==%q",
		api.LabelShimGroup, group, api.LabelSnapshot, imageDir))
	if err != nil {
		log.G(ctx).WithError(err).WithField("group", group).Debug("lazyfork: list the shim group's forks")
		return ""
	}
	for _, ctr := range ctrs {
		if ctr.Runtime.Name != api.RuntimeName {
			continue
		}
		resp, err := c.cd.TaskService().Get(ctx, &tasks.GetRequest{ContainerID: ctr.ID})
		if err != nil {
			continue
		}
		switch resp.GetProcess().GetStatus() {
		case tasktypes.Status_RUNNING, tasktypes.Status_PAUSED, tasktypes.Status_PAUSING, tasktypes.Status_CREATED:
			return ctr.ID
		}
	}
	return ""
}

// open records the group's sandbox (the leader's goroutine, before its
// restore).
func (j *shimJoin) open(ctx context.Context, c *Client, runtime, op string) {
	j.recorded = c.openGroupSandbox(ctx, j.leader, runtime, op)
}

// release lets the group's other forks go: to join the leader's shim when
// its task was created and the record exists, else the usual way (or, the
// leader failed, to fail with the batch). Only the first call counts.
func (j *shimJoin) release(created bool) {
	j.once.Do(func() {
		if created && j.recorded {
			j.sandbox = j.leader
		}
		close(j.ready)
	})
}
