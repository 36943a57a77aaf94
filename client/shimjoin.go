package client

import (
	"context"
	"fmt"
	"maps"
	"slices"
	"sync"
	"time"

	tasks "github.com/containerd/containerd/api/services/tasks/v1"
	tasktypes "github.com/containerd/containerd/api/types/task"
	"github.com/containerd/containerd/v2/core/containers"
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
// each shim group of a call has a leader: a fork of the family whose shim
// the group fills (an earlier call's, shimGroups), else the group's first
// fork, which starts the group's shim as ever.
// The client records a sandbox named after the leader, only while the call
// creates its tasks, and the group's other forks name it as their sandbox.
// A join that fails (the leader's shim went) takes the usual path
// (restoreFork): the group's name then picks its shim, a new one if none
// serves it. Nothing else reads the record: containerd's task create only
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

// shimGroups names the shim group of each groupSize forks of ids and gives
// its join (nil: the group's forks start their shim the usual way, every
// group with cfg.shimJoin off). A family's forks share shims across calls: a
// group whose forks all fit into a shim group of the family that serves
// forks already (a call before this one made it, of this snapshot or
// another) takes that group's name, so its forks run in that shim, and joins
// one of its forks, which leads. Otherwise the group gets a name of its own
// (base), and its first fork starts its shim and leads the others. The
// parent's group is never picked: a shim that dies must not take a parent
// with its forks. Only where LazyFork's annotation picks the shim (joinable)
// does a name pick it; elsewhere each group keeps its base name.
func (c *Client) shimGroups(ctx context.Context, ids []string, groupSize int, base func(k int) string,
	family string, parent containers.Container, parentAnnotations map[string]string, cfg *forkConfig) ([]string, []*shimJoin) {
	sizes := make([]int, (len(ids)+groupSize-1)/groupSize)
	for k := range sizes {
		sizes[k] = min(len(ids), (k+1)*groupSize) - k*groupSize
	}
	names := make([]string, len(sizes))
	joins := make([]*shimJoin, len(sizes))
	if !joinable(parent.Runtime.Name, parentAnnotations) {
		for k := range names {
			names[k] = base(k)
		}
		return names, joins
	}
	groups, taken := c.familyGroups(ctx, family, parent)
	for k, g := range c.pickGroups(ctx, sizes, groupSize, groups) {
		if g != nil {
			names[k] = g.name
			if cfg.shimJoin {
				j := &shimJoin{leader: g.leader, ready: make(chan struct{})}
				j.open(ctx, c, parent.Runtime.Name, cfg.op)
				j.release(true)
				joins[k] = j
			}
			continue
		}
		names[k] = freshGroupName(base(k), taken)
		if cfg.shimJoin && sizes[k] > 1 {
			joins[k] = &shimJoin{leader: ids[k*groupSize], ready: make(chan struct{})}
		}
	}
	return names, joins
}

// familyGroup is a shim group of a family: the forks that carry its name
// (members; its shim serves those alive) and, once looked up, one whose task
// is alive (leader).
type familyGroup struct {
	name    string
	members []string
	leader  string
}

// familyGroups lists the family's shim groups other than the parent's, and
// every group name its forks carry (taken). It reads container records only:
// a task list would ask every shim of the namespace for its state. If
// containerd does not say, there are none: the call's groups start shims of
// their own.
func (c *Client) familyGroups(ctx context.Context, family string, parent containers.Container) ([]familyGroup, map[string]bool) {
	taken := map[string]bool{}
	if family == "" {
		return nil, taken
	}
	ctrs, err := c.cd.ContainerService().List(ctx, fmt.Sprintf("labels.%q==%q", api.LabelFamily, family))
	if err != nil {
		log.G(ctx).WithError(err).WithField("family", family).Debug("lazyfork: list the family's forks")
		return nil, taken
	}
	parentGroup := parent.Labels[api.LabelShimGroup]
	index := map[string]int{}
	var groups []familyGroup
	for _, ctr := range ctrs {
		g := ctr.Labels[api.LabelShimGroup]
		if g == "" {
			continue
		}
		taken[g] = true
		if g == parentGroup || ctr.ID == parent.ID || ctr.Runtime.Name != api.RuntimeName {
			continue
		}
		i, ok := index[g]
		if !ok {
			i = len(groups)
			index[g] = i
			groups = append(groups, familyGroup{name: g})
		}
		groups[i].members = append(groups[i].members, ctr.ID)
	}
	return groups, taken
}

// pickGroups is fillGroups over the family's groups that have a fork whose
// task is alive (its shim serves the group), looked up only for the groups
// fillGroups picks: a group whose forks are all gone is dropped and the
// picks made again.
func (c *Client) pickGroups(ctx context.Context, sizes []int, groupSize int, groups []familyGroup) []*familyGroup {
	for {
		picks := fillGroups(sizes, groupSize, groups)
		dead := -1
		for _, g := range picks {
			if g != nil && g.leader == "" {
				if g.leader = c.liveTask(ctx, g.members); g.leader == "" {
					dead = slices.IndexFunc(groups, func(o familyGroup) bool { return o.name == g.name })
					break
				}
			}
		}
		if dead < 0 {
			return picks
		}
		groups = slices.Delete(groups, dead, dead+1)
	}
}

// liveTask is the first of ids whose task is alive, "" if none is or
// containerd does not say.
func (c *Client) liveTask(ctx context.Context, ids []string) string {
	for _, id := range ids {
		resp, err := c.cd.TaskService().Get(ctx, &tasks.GetRequest{ContainerID: id})
		if err != nil {
			continue
		}
		switch resp.GetProcess().GetStatus() {
		case tasktypes.Status_RUNNING, tasktypes.Status_PAUSED, tasktypes.Status_PAUSING, tasktypes.Status_CREATED:
			return id
		}
	}
	return ""
}

// fillGroups picks for each of a call's groups (sizes, in order) the family
// group whose shim its forks join: the fullest that still has room for all
// of them within groupSize (every fork that carries its name counted, alive
// or not), each at most once; nil where none has (a new shim).
func fillGroups(sizes []int, groupSize int, groups []familyGroup) []*familyGroup {
	picks := make([]*familyGroup, len(sizes))
	used := make([]bool, len(groups))
	for k, m := range sizes {
		best := -1
		for i, g := range groups {
			if !used[i] && len(g.members)+m <= groupSize && (best < 0 || len(g.members) > len(groups[best].members)) {
				best = i
			}
		}
		if best >= 0 {
			used[best] = true
			picks[k] = &groups[best]
		}
	}
	return picks
}

// freshGroupName is base, or base with the first suffix -2, -3, ... that no
// fork of the family carries: a kept snapshot restored again names its
// groups as before, and a full one must not send new forks to its shim.
func freshGroupName(base string, taken map[string]bool) string {
	name := base
	for i := 2; taken[name]; i++ {
		name = fmt.Sprintf("%s-%d", base, i)
	}
	taken[name] = true
	return name
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
