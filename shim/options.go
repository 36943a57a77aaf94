package shim

import (
	"bufio"
	"bytes"
	"fmt"
	"os"
	"strconv"
	"strings"

	runcopts "github.com/containerd/containerd/api/types/runc/options"
	runtimeoptions "github.com/containerd/containerd/api/types/runtimeoptions/v1"
	"github.com/containerd/containerd/v2/pkg/protobuf/types"
	"github.com/containerd/errdefs"
	"github.com/containerd/typeurl/v2"
)

// createOptions turns the options of a task create request into what runc's
// shim understands. containerd's task service sends runc's Options as they are;
// containerd's CRI sends the generic runtimeoptions message (a TOML blob of the
// handler's [options] table) for any runtime type that is not runc's, and runc's
// shim would panic on it, so it is translated into runc's Options here.
func createOptions(a *types.Any) (*types.Any, error) {
	if a == nil || len(a.GetValue()) == 0 && a.GetTypeUrl() == "" {
		return a, nil
	}
	v, err := typeurl.UnmarshalAny(a)
	if err != nil {
		return nil, fmt.Errorf("task options of type %q: %v: %w", a.GetTypeUrl(), err, errdefs.ErrInvalidArgument)
	}
	switch o := v.(type) {
	case *runcopts.Options:
		return a, nil
	case *runtimeoptions.Options:
		ro, err := runcOptionsFromGeneric(o)
		if err != nil {
			return nil, err
		}
		return typeurl.MarshalAnyToProto(ro)
	default:
		return nil, fmt.Errorf("task options of type %T are not supported (want runc options or runtimeoptions): %w", v, errdefs.ErrInvalidArgument)
	}
}

// checkpointOptions accepts runc's CheckpointOptions as they are and treats no
// options, or options of another kind (CRI sends none for a non-runc runtime),
// as a plain leave-running checkpoint.
func checkpointOptions(a *types.Any) (opts *runcopts.CheckpointOptions, keep bool, err error) {
	if a == nil || len(a.GetValue()) == 0 && a.GetTypeUrl() == "" {
		return &runcopts.CheckpointOptions{}, false, nil
	}
	v, err := typeurl.UnmarshalAny(a)
	if err != nil {
		return nil, false, fmt.Errorf("checkpoint options of type %q: %v: %w", a.GetTypeUrl(), err, errdefs.ErrInvalidArgument)
	}
	if o, ok := v.(*runcopts.CheckpointOptions); ok {
		return o, true, nil
	}
	return &runcopts.CheckpointOptions{}, false, nil
}

// runcOptionsFromGeneric reads the runc-compatible keys of a CRI handler's
// [options] table (ConfigBody, or the file at ConfigPath). Unknown keys are
// ignored: they may be LazyFork's own settings or another runtime's.
func runcOptionsFromGeneric(o *runtimeoptions.Options) (*runcopts.Options, error) {
	body := o.GetConfigBody()
	if p := o.GetConfigPath(); p != "" {
		b, err := os.ReadFile(p)
		if err != nil {
			return nil, fmt.Errorf("runtime options config_path: %w", err)
		}
		body = b
	}
	kv, err := parseFlatTOML(body)
	if err != nil {
		return nil, fmt.Errorf("runtime options: %v: %w", err, errdefs.ErrInvalidArgument)
	}
	ro := &runcopts.Options{}
	for k, v := range kv {
		var err error
		switch k {
		case "BinaryName":
			ro.BinaryName, err = tomlString(v)
		case "Root":
			ro.Root, err = tomlString(v)
		case "CriuWorkPath":
			ro.CriuWorkPath, err = tomlString(v)
		case "ShimCgroup":
			ro.ShimCgroup, err = tomlString(v)
		case "SystemdCgroup":
			ro.SystemdCgroup, err = strconv.ParseBool(v)
		case "NoPivotRoot":
			ro.NoPivotRoot, err = strconv.ParseBool(v)
		case "NoNewKeyring":
			ro.NoNewKeyring, err = strconv.ParseBool(v)
		case "IoUid", "IoGid":
			var n uint64
			n, err = strconv.ParseUint(v, 10, 32)
			if k == "IoUid" {
				ro.IoUid = uint32(n)
			} else {
				ro.IoGid = uint32(n)
			}
		}
		if err != nil {
			return nil, fmt.Errorf("runtime option %s = %s: %v: %w", k, v, err, errdefs.ErrInvalidArgument)
		}
	}
	return ro, nil
}

// parseFlatTOML reads the top-level `key = value` pairs of a TOML document (what
// containerd marshals from a handler's flat [options] table); tables are skipped.
func parseFlatTOML(b []byte) (map[string]string, error) {
	kv := map[string]string{}
	sc := bufio.NewScanner(bytes.NewReader(b))
	inTable := false
	for sc.Scan() {
		line := strings.TrimSpace(sc.Text())
		if line == "" || strings.HasPrefix(line, "#") {
			continue
		}
		if strings.HasPrefix(line, "[") {
			inTable = true
			continue
		}
		if inTable {
			continue
		}
		k, v, ok := strings.Cut(line, "=")
		if !ok {
			return nil, fmt.Errorf("not a key = value line: %q", line)
		}
		k = strings.Trim(strings.TrimSpace(k), `"'`)
		kv[k] = strings.TrimSpace(v)
	}
	return kv, sc.Err()
}

func tomlString(v string) (string, error) {
	switch {
	case len(v) >= 2 && v[0] == '\'' && v[len(v)-1] == '\'':
		return v[1 : len(v)-1], nil
	case len(v) >= 2 && v[0] == '"':
		return strconv.Unquote(v)
	}
	return "", fmt.Errorf("not a string")
}
