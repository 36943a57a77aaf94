package client

import (
	"context"
	"fmt"
	"os"
	"strconv"

	v1 "github.com/containerd/cgroups/v3/cgroup1/stats"
	v2 "github.com/containerd/cgroups/v3/cgroup2/stats"
	containerd "github.com/containerd/containerd/v2/client"
	"github.com/containerd/containerd/v2/pkg/identifiers"
	"github.com/containerd/errdefs"
	"github.com/containerd/typeurl/v2"
)

// DefaultMaxForks bounds the forks one Fork call makes (WithMaxForks,
// LAZYFORK_MAX_FORKS, the CLI's --max raise it).
const DefaultMaxForks = 256

// MinForkMemory is the memory (MemAvailable) a fork needs at the least right
// after its restore: its page tables, the kernel's task structures, CRIU's
// restorer leftovers.
const MinForkMemory = 2 << 20

// checkCount refuses n above the limit before anything happens.
func checkCount(parentID string, n, limit int) error {
	if n > limit {
		return fmt.Errorf("fork %s: %d forks asked, more than the limit of %d per call (raise it with --max N, LAZYFORK_MAX_FORKS=N or client.WithMaxForks): %w",
			parentID, n, limit, errdefs.ErrInvalidArgument)
	}
	return nil
}

// checkIDs validates the forks' ids against containerd's identifier rules,
// against each other and against the containers that exist.
func (c *Client) checkIDs(ctx context.Context, parentID string, ids []string) error {
	seen := make(map[string]bool, len(ids))
	for _, id := range ids {
		if err := identifiers.Validate(id); err != nil {
			return fmt.Errorf("fork %s: fork name %q: %w", parentID, id, err)
		}
		if seen[id] {
			return fmt.Errorf("fork %s: fork name %q given twice: %w", parentID, id, errdefs.ErrInvalidArgument)
		}
		seen[id] = true
	}
	ctrs, err := c.cd.ContainerService().List(ctx)
	if err != nil {
		return fmt.Errorf("fork %s: list containers: %w", parentID, err)
	}
	for _, x := range ctrs {
		if seen[x.ID] {
			return fmt.Errorf("fork %s: a container named %q exists (choose another name or delete it): %w", parentID, x.ID, errdefs.ErrAlreadyExists)
		}
	}
	return nil
}

// checkResources refuses a fork the node cannot hold: each fork needs
// MinForkMemory of the node's MemAvailable, and the snapshot about the
// parent's anonymous memory free in ROOT (its tmpfs). Figures it cannot
// read are not checked.
func (c *Client) checkResources(ctx context.Context, parentID string, task containerd.Task, n int) error {
	sp, err := c.node.FreeSpace(ctx)
	if err != nil {
		if errdefs.IsUnavailable(err) {
			return fmt.Errorf("fork %s: %w", parentID, err)
		}
		return nil
	}
	if err := checkMemory(parentID, n, sp.MemAvailable); err != nil {
		return err
	}
	if task == nil {
		return nil
	}
	need, err := taskAnonMemory(ctx, task)
	if err != nil || need == 0 || sp.Free == 0 && sp.Root == "" {
		return nil
	}
	if need > sp.Free {
		return fmt.Errorf("fork %s: its snapshot needs about %d MiB (the parent's memory) in %s, which has %d MiB free: free space there (lazyfork gc removes leftovers) or enlarge its tmpfs: %w",
			parentID, need>>20, sp.Root, sp.Free>>20, errdefs.ErrResourceExhausted)
	}
	return nil
}

// checkMemory refuses n forks if the node's available memory (avail, 0 if
// unknown) lacks MinForkMemory each.
func checkMemory(parentID string, n int, avail uint64) error {
	if avail > 0 && n > 0 && uint64(n)*MinForkMemory > avail {
		return fmt.Errorf("fork %s: %d forks need at least %d MiB of memory (%d MiB each), the node has %d MiB available (MemAvailable): fork fewer or free memory: %w",
			parentID, n, uint64(n)*MinForkMemory>>20, MinForkMemory>>20, avail>>20, errdefs.ErrResourceExhausted)
	}
	return nil
}

// taskAnonMemory is the anonymous memory of a task's cgroup (what a dump
// writes), from its metrics.
func taskAnonMemory(ctx context.Context, task containerd.Task) (uint64, error) {
	m, err := task.Metrics(ctx)
	if err != nil {
		return 0, err
	}
	v, err := typeurl.UnmarshalAny(m.Data)
	if err != nil {
		return 0, err
	}
	switch s := v.(type) {
	case *v2.Metrics:
		if s.Memory != nil {
			return s.Memory.Anon, nil
		}
	case *v1.Metrics:
		if s.Memory != nil {
			return s.Memory.TotalRSS, nil
		}
	}
	return 0, fmt.Errorf("no memory figures in the metrics: %w", errdefs.ErrNotImplemented)
}

// maxForksFromEnv is LAZYFORK_MAX_FORKS, or DefaultMaxForks.
func maxForksFromEnv() int {
	if v, err := strconv.Atoi(os.Getenv("LAZYFORK_MAX_FORKS")); err == nil && v > 0 {
		return v
	}
	return DefaultMaxForks
}
