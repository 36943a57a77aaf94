package shim

import (
	"bytes"
	"context"
	"io"
	"os"
	"path/filepath"

	bootapi "github.com/containerd/containerd/api/runtime/bootstrap/v1"
	"github.com/containerd/containerd/api/types"
	runtimeoptions "github.com/containerd/containerd/api/types/runtimeoptions/v1"
	"github.com/containerd/containerd/v2/cmd/containerd-shim-runc-v2/manager"
	"github.com/containerd/containerd/v2/pkg/protobuf/proto"
	ptypes "github.com/containerd/containerd/v2/pkg/protobuf/types"
	"github.com/containerd/containerd/v2/pkg/shim"
	"github.com/containerd/log"
	"github.com/containerd/typeurl/v2"

	"github.com/lazyfork/lazyfork/internal/shimaddr"
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
	// The front binary (cmd/containerd-shim-lazyfork-v1) answers the starts
	// that find their shim running, and starts a new shim itself as runc's
	// manager does (package internal/shimspawn), with the same group, lock
	// and spec rewrite (shimaddr.PrepareStart); it hands this one the starts
	// it cannot be sure to do alike (a shim cgroup, core scheduling), with
	// the group's start lock when it took it.
	st, err := shimaddr.PrepareStart(".", shimaddr.SocketDir(params.GetSocketDir()), params.GetInstanceID())
	if err != nil {
		return nil, err
	}
	// Held until runc's manager has the new shim's socket listening (or
	// found the group's shim running): the group's next start finds it.
	defer st.Release()
	if err := st.WriteGroup(); err != nil {
		return nil, err
	}
	return m.Shim.Start(ctx, params)
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
