package shim

import (
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	runcopts "github.com/containerd/containerd/api/types/runc/options"
	"github.com/containerd/containerd/v2/pkg/protobuf/types"
	"github.com/containerd/errdefs"
	"github.com/containerd/typeurl/v2"
	specs "github.com/opencontainers/runtime-spec/specs-go"

	"github.com/lazyfork/lazyfork/api"
	"github.com/lazyfork/lazyfork/internal/procfs"
	"github.com/lazyfork/lazyfork/memfile/madvguard"
	"github.com/lazyfork/lazyfork/memfile/rehome/movehelper"
)

// Annotations of other software the shim reads or writes; LazyFork's own are
// in package api, the shim grouping ones in internal/shimaddr.
const (
	// CRI's annotations naming a container's type and name.
	annotationCRIContainerType = "io.kubernetes.cri.container-type"
	annotationCRIContainerName = "io.kubernetes.cri.container-name"
	// annotationCRISandboxNamespace is the Kubernetes namespace of a CRI
	// container's pod, set by CRI itself (a pod cannot set io.kubernetes.*
	// annotations through pod_annotations).
	annotationCRISandboxNamespace = "io.kubernetes.cri.sandbox-namespace"
)

// Config is the shim's configuration, read from the environment containerd gives it.
type Config struct {
	// Root is LazyFork's tmpfs; the family memory store is Root/mem.
	Root string
	// TmpfsSize is the size of the tmpfs LazyFork mounts at Root, in bytes.
	TmpfsSize int64
	// Overcommit is the value of vm.overcommit_memory containers see, or "" to
	// leave the host's value visible.
	Overcommit string
	// CRIUVerbosity is the log level CRIU runs at for LazyFork containers
	// ("" = runc's choice, 4). CRIU restores inside the fork's memory cgroup,
	// so its log is page cache charged to every fork.
	CRIUVerbosity string
	// Madvise is the default madvise guard mode of checkpoints: "refuse",
	// "zero" or "off"; a container's lazyfork.io/madvise annotation wins.
	Madvise string
	// ArchiveDirs are the host directories from which lazyfork.io/fork-of may
	// name a checkpoint archive (kubelet's checkpoint directory by default).
	ArchiveDirs []string
	// RestoreTimeout bounds the restore of one task: a restore that does not
	// finish in time is killed and cleaned up.
	RestoreTimeout time.Duration
	// Rehome moves a container's private memory onto its family's memory
	// files at each checkpoint (lazyfork.io/rehome=false opts one out).
	Rehome bool
	// RehomeStandby is how long a started move helper waits for the next
	// move (standbyHelper; 0: none waits, each move starts its own).
	RehomeStandby time.Duration
	// PreCopy copies a container's memory before its first move's freeze,
	// when a client announces the snapshot and it holds at least
	// PreCopyMin bytes of private anonymous memory (precopy.go).
	PreCopy    bool
	PreCopyMin int64
	// PatchDeltas leaves a container that moved onto its files running on
	// them at its later snapshots: its dump holds what it wrote since its
	// last move, which the rewrite turns into patches for the forks, and it
	// moves again only to consolidate (patched.go). Off, every snapshot
	// moves it.
	PatchDeltas bool
	// RuncRoot is runc's state root for containers whose runtime options name
	// none ("": runc's /run/containerd/runc). CgroupParent, when set, holds the
	// cgroups of containers that have containerd's default cgroupsPath
	// (/NAMESPACE/ID). `lazyfork setup` sets both for a private stack, so that
	// two stacks never share runc's state or a cgroup: the same container id
	// in both collided in runc's root, and stopping one killed the other's
	// processes in their common cgroup.
	RuncRoot, CgroupParent string
}

// privateStack gives a container being created the stack's own runc root
// (in its runtime options, which runc's shim keeps in the bundle for `shim
// delete` too) and cgroup parent (in its spec).
func (c Config) privateStack(opts *types.Any, spec *specs.Spec, ns, id string) (*types.Any, error) {
	if c.CgroupParent != "" && spec.Linux != nil && spec.Linux.CgroupsPath == "/"+ns+"/"+id {
		spec.Linux.CgroupsPath = filepath.Join(c.CgroupParent, ns, id)
	}
	if c.RuncRoot == "" {
		return opts, nil
	}
	ro := &runcopts.Options{}
	if opts != nil && (len(opts.GetValue()) > 0 || opts.GetTypeUrl() != "") {
		v, err := typeurl.UnmarshalAny(opts)
		if err != nil {
			return nil, fmt.Errorf("task options: %w", err)
		}
		o, ok := v.(*runcopts.Options)
		if !ok {
			return opts, nil // createOptions has turned every kind it takes into runc's
		}
		if o.Root != "" {
			return opts, nil
		}
		ro = o
	}
	ro.Root = c.RuncRoot
	return typeurl.MarshalAnyToProto(ro)
}

// DefaultArchiveDir is where kubelet writes checkpoint archives.
const DefaultArchiveDir = "/var/lib/kubelet/checkpoints"

// DefaultRestoreTimeout is the default of Config.RestoreTimeout.
const DefaultRestoreTimeout = 2 * time.Minute

// DefaultPreCopyMin is the default of Config.PreCopyMin: below it the first
// move's copy in the pause is some tens of milliseconds, and a precopy adds
// about as much to the call (bench-refork, 64 MiB: the pause 145 -> 129 ms,
// the call 340 -> 460 ms).
const DefaultPreCopyMin = movehelper.MinPreCopy

// parseMiB parses a size in M or G (binary units).
func parseMiB(v string) (int64, error) {
	unit := int64(1 << 20)
	num := strings.TrimSuffix(strings.TrimSuffix(v, "B"), "i")
	switch {
	case strings.HasSuffix(num, "G"):
		unit, num = 1<<30, strings.TrimSuffix(num, "G")
	case strings.HasSuffix(num, "M"):
		num = strings.TrimSuffix(num, "M")
	default:
		return 0, fmt.Errorf("no unit (M or G)")
	}
	n, err := strconv.ParseInt(num, 10, 64)
	if err != nil || n < 0 {
		return 0, fmt.Errorf("not a size")
	}
	return n * unit, nil
}

// DefaultRehomeStandby is the default of Config.RehomeStandby.
const DefaultRehomeStandby = time.Minute

// MemRoot is the root of the family memory store.
func (c Config) MemRoot() string { return api.Root(c.Root).Mem() }

// ConfigFromEnv reads LAZYFORK_ROOT, LAZYFORK_TMPFS_SIZE, LAZYFORK_OVERCOMMIT,
// LAZYFORK_CRIU_VERBOSITY, LAZYFORK_MADVISE, LAZYFORK_ARCHIVE_DIRS,
// LAZYFORK_RESTORE_TIMEOUT, LAZYFORK_REHOME, LAZYFORK_REHOME_STANDBY, LAZYFORK_PRECOPY,
// LAZYFORK_PATCH_DELTAS,
// LAZYFORK_RUNC_ROOT and LAZYFORK_CGROUP_PARENT.
func ConfigFromEnv() (Config, error) {
	c := Config{Root: api.DefaultRoot, Overcommit: "2", CRIUVerbosity: "1", Madvise: "refuse",
		ArchiveDirs: []string{DefaultArchiveDir}, RestoreTimeout: DefaultRestoreTimeout, Rehome: true, RehomeStandby: DefaultRehomeStandby, PreCopy: true, PreCopyMin: DefaultPreCopyMin, PatchDeltas: true}
	for _, sw := range []struct {
		name, want string
		on         *bool
	}{
		{"LAZYFORK_REHOME", "on or off", &c.Rehome},
		{"LAZYFORK_PATCH_DELTAS", "on (later snapshots leave a container on its files and patch its forks) or off (every snapshot moves it)", &c.PatchDeltas},
	} {
		switch v := os.Getenv(sw.name); v {
		case "", "on", "true", "1":
		case "off", "false", "0":
			*sw.on = false
		default:
			return c, fmt.Errorf("%s %q: want %s: %w", sw.name, v, sw.want, errdefs.ErrInvalidArgument)
		}
	}
	switch v := os.Getenv("LAZYFORK_PRECOPY"); v {
	case "", "on", "true", "1":
	case "off", "false", "0":
		c.PreCopy = false
	default:
		n, err := parseMiB(v)
		if err != nil {
			return c, fmt.Errorf("LAZYFORK_PRECOPY %q: want on, off, or the least memory a container holds for a precopy, such as 64M or 1G: %w", v, errdefs.ErrInvalidArgument)
		}
		c.PreCopyMin = n
	}
	if v, ok := os.LookupEnv("LAZYFORK_ARCHIVE_DIRS"); ok {
		c.ArchiveDirs = nil
		for _, d := range filepath.SplitList(v) {
			if d == "" {
				continue
			}
			if !filepath.IsAbs(d) {
				return c, fmt.Errorf("LAZYFORK_ARCHIVE_DIRS: %q must be absolute: %w", d, errdefs.ErrInvalidArgument)
			}
			c.ArchiveDirs = append(c.ArchiveDirs, filepath.Clean(d))
		}
	}
	switch v := os.Getenv("LAZYFORK_REHOME_STANDBY"); v {
	case "":
	case "off", "0":
		c.RehomeStandby = 0
	default:
		d, err := time.ParseDuration(v)
		if err != nil || d <= 0 {
			return c, fmt.Errorf("LAZYFORK_REHOME_STANDBY %q: want how long a move's helper waits for the next move, such as 1m, or off: %w", v, errdefs.ErrInvalidArgument)
		}
		c.RehomeStandby = d
	}
	if v := os.Getenv("LAZYFORK_RESTORE_TIMEOUT"); v != "" {
		d, err := time.ParseDuration(v)
		if err != nil || d <= 0 {
			return c, fmt.Errorf("LAZYFORK_RESTORE_TIMEOUT %q: want a positive duration such as 2m: %w", v, errdefs.ErrInvalidArgument)
		}
		c.RestoreTimeout = d
	}
	if v := os.Getenv("LAZYFORK_MADVISE"); v != "" {
		if _, _, err := parseMadvise(v); err != nil {
			return c, fmt.Errorf("LAZYFORK_MADVISE: %w", err)
		}
		c.Madvise = v
	}
	if v := os.Getenv("LAZYFORK_ROOT"); v != "" {
		if !filepath.IsAbs(v) {
			return c, fmt.Errorf("LAZYFORK_ROOT %q must be absolute: %w", v, errdefs.ErrInvalidArgument)
		}
		c.Root = filepath.Clean(v)
	}
	for _, e := range []struct {
		name string
		dst  *string
	}{{"LAZYFORK_RUNC_ROOT", &c.RuncRoot}, {"LAZYFORK_CGROUP_PARENT", &c.CgroupParent}} {
		if v := os.Getenv(e.name); v != "" {
			if !filepath.IsAbs(v) || strings.Contains(v, "..") {
				return c, fmt.Errorf("%s %q must be an absolute path: %w", e.name, v, errdefs.ErrInvalidArgument)
			}
			*e.dst = filepath.Clean(v)
		}
	}
	if v := os.Getenv("LAZYFORK_TMPFS_SIZE"); v != "" {
		n, err := strconv.ParseInt(v, 10, 64)
		if err != nil || n <= 0 {
			return c, fmt.Errorf("LAZYFORK_TMPFS_SIZE %q is not a positive byte count: %w", v, errdefs.ErrInvalidArgument)
		}
		c.TmpfsSize = n
	} else {
		c.TmpfsSize = halfOfRAM()
	}
	switch v := os.Getenv("LAZYFORK_CRIU_VERBOSITY"); v {
	case "":
	case "runc", "off":
		c.CRIUVerbosity = ""
	case "0", "1", "2", "3", "4":
		c.CRIUVerbosity = v
	default:
		return c, fmt.Errorf("LAZYFORK_CRIU_VERBOSITY %q: want 0..4 or runc: %w", v, errdefs.ErrInvalidArgument)
	}
	switch v := os.Getenv("LAZYFORK_OVERCOMMIT"); v {
	case "":
	case "off", "none":
		c.Overcommit = ""
	case "0", "1", "2":
		c.Overcommit = v
	default:
		return c, fmt.Errorf("LAZYFORK_OVERCOMMIT %q: want 0, 1, 2 or off: %w", v, errdefs.ErrInvalidArgument)
	}
	return c, nil
}

// halfOfRAM is the default tmpfs size, tmpfs's own default.
func halfOfRAM() int64 {
	total, err := procfs.MemInfo("MemTotal")
	if err != nil {
		return 1 << 30
	}
	return total / 2
}

// parseMadvise reads a madvise guard mode: refuse, zero, or off (guard=false).
func parseMadvise(v string) (mode madvguard.Mode, guard bool, err error) {
	if v == "off" {
		return madvguard.Refuse, false, nil
	}
	if v == "" {
		return madvguard.Refuse, true, nil
	}
	mode, err = madvguard.ParseMode(v)
	if err != nil {
		return 0, false, fmt.Errorf("madvise mode %q (want refuse, zero or off): %w", v, errdefs.ErrInvalidArgument)
	}
	return mode, true, nil
}
