//go:build linux

package snapshotter

import (
	"context"
	"fmt"
	"strings"

	"github.com/containerd/containerd/v2/core/snapshots"
	"github.com/containerd/containerd/v2/core/snapshots/storage"
	"github.com/containerd/errdefs"

	"github.com/lazyfork/lazyfork/snapshotter/client"
)

// FreezeSourceLabel on a Prepare names the active snapshot whose upper dir
// becomes the new snapshot's layer. It has containerd's snapshot label prefix
// so that containerd passes it on to a proxy snapshotter. Its value is the key
// as the caller knows it: the exact backend key, or, through containerd, the
// key inside the caller's namespace (backend keys are "<ns>/<n>/<key>").
const FreezeSourceLabel = client.FreezeSourceLabel

// resolveFreezeSource finds the active snapshot a freeze copies and checks
// that the new snapshot will have the same parent, so that the frozen layer
// stacks exactly where the active's upper dir stacked.
func (s *Snapshotter) resolveFreezeSource(ctx context.Context, newKey, source, parent string) (key, id string, err error) {
	if source == "" {
		return "", "", fmt.Errorf("empty %s: %w", FreezeSourceLabel, errdefs.ErrInvalidArgument)
	}
	var info snapshots.Info
	err = s.ms.WithTransaction(ctx, false, func(ctx context.Context) error {
		key = source
		if _, _, _, err := storage.GetInfo(ctx, source); err != nil {
			if !errdefs.IsNotFound(err) {
				return err
			}
			key, err = findNamespacedKey(ctx, newKey, source)
			if err != nil {
				return err
			}
		}
		var err error
		id, info, _, err = storage.GetInfo(ctx, key)
		return err
	})
	if err != nil {
		return "", "", fmt.Errorf("freeze source %q: %w", source, err)
	}
	if info.Kind != snapshots.KindActive {
		return "", "", fmt.Errorf("freeze source %q is %v, not an active snapshot: %w", source, info.Kind, errdefs.ErrInvalidArgument)
	}
	if info.Parent != parent {
		return "", "", fmt.Errorf("freeze of %q must be prepared on its parent %q, not %q: %w", source, info.Parent, parent, errdefs.ErrInvalidArgument)
	}
	return key, id, nil
}

// findNamespacedKey maps a key the way containerd's metadata store names it
// in the backend ("<ns>/<n>/<key>") using the namespace of newKey, which
// containerd named the same way.
func findNamespacedKey(ctx context.Context, newKey, source string) (string, error) {
	ns, _, ok := strings.Cut(newKey, "/")
	if !ok {
		return "", fmt.Errorf("no snapshot %q: %w", source, errdefs.ErrNotFound)
	}
	var found []string
	err := walkInfo(ctx, func(ctx context.Context, info snapshots.Info) error {
		if info.Kind != snapshots.KindActive {
			return nil
		}
		rest, ok := strings.CutPrefix(info.Name, ns+"/")
		if !ok {
			return nil
		}
		n, k, ok := strings.Cut(rest, "/")
		if ok && k == source && n != "" && strings.Trim(n, "0123456789") == "" {
			found = append(found, info.Name)
		}
		return nil
	})
	if err != nil {
		return "", err
	}
	switch len(found) {
	case 0:
		return "", fmt.Errorf("no active snapshot %q in namespace %q: %w", source, ns, errdefs.ErrNotFound)
	case 1:
		return found[0], nil
	default:
		return "", fmt.Errorf("%d active snapshots named %q in namespace %q: %w", len(found), source, ns, errdefs.ErrFailedPrecondition)
	}
}

// Freeze makes the frozen layer frozenName from the active snapshot
// activeKey in process (see client.Freeze, which does the same through
// containerd).
func (s *Snapshotter) Freeze(ctx context.Context, activeKey, frozenName string, opts ...snapshots.Opt) (snapshots.Info, error) {
	return client.Freeze(ctx, s, activeKey, frozenName, opts...)
}
