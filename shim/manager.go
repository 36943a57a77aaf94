package shim

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
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

// Start groups the containers of a family into one shim process. runc's manager
// groups by the io.containerd.runc.v2.group annotation (then a CRI sandbox id);
// a container carrying lazyfork.io/family and neither of those gets the group
// annotation set to its family before runc's manager reads the bundle. A root
// container's family is its id, which is also runc's default group, so the
// family's forks land in the root's shim.
func (m *lfManager) Start(ctx context.Context, params *bootapi.BootstrapParams) (*bootapi.BootstrapResult, error) {
	if err := groupByFamily("."); err != nil {
		return nil, err
	}
	return m.Shim.Start(ctx, params)
}

func groupByFamily(bundle string) error {
	path := filepath.Join(bundle, specFile)
	b, err := os.ReadFile(path)
	if err != nil {
		return err
	}
	// Only the annotations are touched; the rest of the document is kept as is.
	var doc map[string]json.RawMessage
	if err := json.Unmarshal(b, &doc); err != nil {
		return fmt.Errorf("decode bundle spec: %w", err)
	}
	ann := map[string]string{}
	if raw, ok := doc["annotations"]; ok {
		if err := json.Unmarshal(raw, &ann); err != nil {
			return fmt.Errorf("decode spec annotations: %w", err)
		}
	}
	family := ann[AnnotationFamily]
	if family == "" || ann[AnnotationRuncGroup] != "" || ann[AnnotationCRISandbox] != "" {
		return nil
	}
	ann[AnnotationRuncGroup] = family
	raw, err := json.Marshal(ann)
	if err != nil {
		return err
	}
	doc["annotations"] = raw
	out, err := json.Marshal(doc)
	if err != nil {
		return err
	}
	return writeFileAtomic(path, out, 0o600)
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
