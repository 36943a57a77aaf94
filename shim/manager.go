package shim

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"path/filepath"

	bootapi "github.com/containerd/containerd/api/runtime/bootstrap/v1"
	"github.com/containerd/containerd/api/types"
	runtimeoptions "github.com/containerd/containerd/api/types/runtimeoptions/v1"
	"github.com/containerd/containerd/v2/cmd/containerd-shim-runc-v2/manager"
	"github.com/containerd/containerd/v2/pkg/identifiers"
	"github.com/containerd/containerd/v2/pkg/protobuf/proto"
	ptypes "github.com/containerd/containerd/v2/pkg/protobuf/types"
	"github.com/containerd/containerd/v2/pkg/shim"
	"github.com/containerd/log"
	"github.com/containerd/typeurl/v2"
	"golang.org/x/sys/unix"

	"github.com/lazyfork/lazyfork/api"
)

// NewManager returns the shim manager of io.containerd.lazyfork.v1: runc's
// manager, with containers grouped by family and LazyFork's state released
// by the `delete` subcommand.
func NewManager(name string) shim.Shim {
	return &lfManager{Shim: manager.NewShimManager(name)}
}

type lfManager struct {
	shim.Shim
}

var _ shim.Shim = (*lfManager)(nil)

// Start chooses the shim process of a container. One shim failure must not
// take a family down, so a family is never one shim: a root container (and
// any container without lazyfork.io/shim-group) gets a shim of its own, as
// runc's manager gives by default, and forks that carry the same
// lazyfork.io/shim-group (one batch of one fork call, bounded by the client)
// share one, never their parent's. The annotation is honoured only where
// runc's own grouping (io.containerd.runc.v2.group, a CRI sandbox) does not
// apply, and a shim socket is per containerd namespace, so it cannot join a
// container of another namespace or pod.
func (m *lfManager) Start(ctx context.Context, params *bootapi.BootstrapParams) (*bootapi.BootstrapResult, error) {
	group, err := groupByShimGroup(".")
	if err != nil {
		return nil, err
	}
	if group != "" {
		// runc's manager starts a second shim for a group when another
		// `shim start` of it has bound the socket but not yet listened
		// (it takes the refused connection for a stale socket and replaces
		// it): forks of one batch restore at once, so serialise their starts.
		unlock, err := lockShimStart(params.GetSocketDir(), group)
		if err != nil {
			return nil, err
		}
		defer unlock()
	}
	return m.Shim.Start(ctx, params)
}

// lockShimStart takes an flock for the starts of one shim group, on a file
// beside the shim sockets that the last holder removes.
func lockShimStart(socketDir, group string) (func(), error) {
	if socketDir == "" {
		socketDir = "/run/containerd/s"
	}
	if err := os.MkdirAll(socketDir, 0o711); err != nil {
		return nil, err
	}
	sum := sha256.Sum256([]byte(group))
	path := filepath.Join(socketDir, ".lazyfork-start-"+hex.EncodeToString(sum[:12])+".lock")
	for {
		f, err := os.OpenFile(path, os.O_CREATE|os.O_RDWR, 0o600)
		if err != nil {
			return nil, fmt.Errorf("lock the start of shim group %s: %w", group, err)
		}
		if err := unix.Flock(int(f.Fd()), unix.LOCK_EX); err != nil {
			f.Close()
			return nil, fmt.Errorf("lock the start of shim group %s: %w", group, err)
		}
		// The previous holder may have removed the file after we opened it:
		// then ours is a lock nobody else sees; take the new one.
		var held, now unix.Stat_t
		if unix.Fstat(int(f.Fd()), &held) == nil && unix.Stat(path, &now) == nil && held.Ino == now.Ino && held.Dev == now.Dev {
			return func() { os.Remove(path); f.Close() }, nil
		}
		f.Close()
	}
}

// shimGroupPrefix keeps LazyFork's groups apart from container ids (runc's
// default group is the container's own id).
const shimGroupPrefix = "lazyfork-group-"

// shimGroupID turns a group name into runc's group: the name itself when it
// is a short, plain identifier, else a digest of it (a family and a snapshot
// name together may exceed containerd's 76 characters).
func shimGroupID(group string) string {
	if id := shimGroupPrefix + group; identifiers.Validate(id) == nil {
		return id
	}
	sum := sha256.Sum256([]byte(group))
	return shimGroupPrefix + hex.EncodeToString(sum[:16])
}

// groupByShimGroup sets runc's group from lazyfork.io/shim-group and returns
// the group it set ("" when it set none).
func groupByShimGroup(bundle string) (string, error) {
	path := filepath.Join(bundle, specFile)
	b, err := os.ReadFile(path)
	if err != nil {
		return "", err
	}
	// Only the annotations are touched; the rest of the document is kept as is.
	var doc map[string]json.RawMessage
	if err := json.Unmarshal(b, &doc); err != nil {
		return "", fmt.Errorf("decode bundle spec: %w", err)
	}
	ann := map[string]string{}
	if raw, ok := doc["annotations"]; ok {
		if err := json.Unmarshal(raw, &ann); err != nil {
			return "", fmt.Errorf("decode spec annotations: %w", err)
		}
	}
	group := ann[api.AnnotationShimGroup]
	if group == "" || ann[AnnotationRuncGroup] != "" || ann[AnnotationCRISandbox] != "" {
		return "", nil
	}
	ann[AnnotationRuncGroup] = shimGroupID(group)
	raw, err := json.Marshal(ann)
	if err != nil {
		return "", err
	}
	doc["annotations"] = raw
	out, err := json.Marshal(doc)
	if err != nil {
		return "", err
	}
	return ann[AnnotationRuncGroup], writeFileAtomic(path, out, 0o600)
}

// Stop is the `delete` subcommand, run when a shim is gone: runc's cleanup, then
// the container's memory-file reference and any cgroup a failed restore left.
func (m *lfManager) Stop(ctx context.Context, id string) (shim.StopStatus, error) {
	ss, err := m.Shim.Stop(ctx, id)
	if err != nil {
		return ss, err
	}
	cwd, cerr := os.Getwd()
	if cerr != nil {
		return ss, nil
	}
	bundle := filepath.Join(filepath.Dir(cwd), id)
	st, serr := readState(bundle)
	if serr != nil || st == nil {
		if serr != nil {
			log.G(ctx).WithError(serr).Warn("lazyfork: read container state")
		}
		return ss, nil
	}
	cfg, cerr := ConfigFromEnv()
	if cerr != nil {
		log.G(ctx).WithError(cerr).Warn("lazyfork: config")
		return ss, nil
	}
	if err := releaseContainer(ctx, cfg, st); err != nil {
		log.G(ctx).WithError(err).Warn("lazyfork: release container")
	}
	return ss, nil
}

// Info answers `shim -info`. CRI passes a handler's generic runtimeoptions,
// which runc's manager rejects; those are dropped, runc's Options kept.
func (m *lfManager) Info(ctx context.Context, optionsR io.Reader) (*types.RuntimeInfo, error) {
	data, err := io.ReadAll(optionsR)
	if err != nil {
		return nil, err
	}
	if len(data) > 0 {
		var a ptypes.Any
		if err := proto.Unmarshal(data, &a); err == nil {
			if v, err := typeurl.UnmarshalAny(&a); err == nil {
				if _, generic := v.(*runtimeoptions.Options); generic {
					data = nil
				}
			}
		}
	}
	return m.Shim.Info(ctx, bytes.NewReader(data))
}
