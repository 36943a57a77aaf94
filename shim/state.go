package shim

import (
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"

	"github.com/lazyfork/lazyfork/api"
	"github.com/lazyfork/lazyfork/memfile"
)

// legacyStateFile is where shims before api.BundleStateFile kept the state (the
// same name as a snapshot's record); bundles they made are still read.
const legacyStateFile = "lazyfork.json"

// containerState is what LazyFork knows about one container, kept in its bundle
// so that the `delete` subcommand (run after a shim died) can release it.
type containerState struct {
	Namespace string `json:"namespace"`
	ID        string `json:"id"`
	Family    string `json:"family"`
	// Holder is the memfile reference the container holds on its family:
	// a fork's on its files, a root's with none (taken with the family's
	// claim); "" for roots made by older shims, held by their view alone.
	Holder string `json:"holder,omitempty"`
	// Snapshot is the LazyFork snapshot the task was restored from.
	Snapshot string `json:"snapshot,omitempty"`
	// CgroupsPath is the spec's linux.cgroupsPath, removed on delete if a
	// failed restore left it behind.
	CgroupsPath string `json:"cgroupsPath,omitempty"`
	// Madvise is the container's lazyfork.io/madvise annotation ("" = the
	// shim's default): the guard its checkpoints carry.
	Madvise string `json:"madvise,omitempty"`
	// Unpacked is the directory under ROOT/snapshots holding the image
	// unpacked from a checkpoint archive named by lazyfork.io/fork-of;
	// removed with the container.
	Unpacked string `json:"unpacked,omitempty"`
	// View is the container's memory view (memfile.ViewName): the directory
	// mounted at /.lazyfork/mem, holding only its lineage's files.
	View string `json:"view,omitempty"`
	// PodNamespace is the Kubernetes namespace of a CRI container's pod.
	PodNamespace string `json:"podNamespace,omitempty"`
	// Forkable is the container's lazyfork.io/forkable opt-in, recorded in
	// its snapshots.
	Forkable bool `json:"forkable,omitempty"`
	// Rehome is the container's lazyfork.io/rehome annotation ("false" opts
	// out of moving onto its memory files at checkpoint).
	Rehome string `json:"rehome,omitempty"`
	// MovedFiles are the memory files the container's own processes map
	// since they were moved onto them (in its view, pinned by Holder).
	MovedFiles []string `json:"movedFiles,omitempty"`
}

func writeState(bundle string, st *containerState) error {
	b, err := json.Marshal(st)
	if err != nil {
		return err
	}
	return writeFileAtomic(filepath.Join(bundle, api.BundleStateFile), b, 0o600)
}

// readState returns nil, nil when the bundle has no LazyFork state.
func readState(bundle string) (*containerState, error) {
	name := api.BundleStateFile
	b, err := os.ReadFile(filepath.Join(bundle, name))
	if errors.Is(err, os.ErrNotExist) {
		name = legacyStateFile
		b, err = os.ReadFile(filepath.Join(bundle, name))
	}
	if errors.Is(err, os.ErrNotExist) {
		return nil, nil
	}
	if err != nil {
		return nil, err
	}
	var st containerState
	if err := json.Unmarshal(b, &st); err != nil {
		return nil, fmt.Errorf("decode %s: %w", filepath.Join(bundle, name), err)
	}
	return &st, nil
}

// containerHolder is the memfile reference a container holds.
func containerHolder(ns, id string) string { return memfile.HolderContainer + ns + "/" + id }

// exportHolder is the memfile reference a container holds on the files of the
// snapshots containerd exported to its content store.
func exportHolder(ns, id string) string { return "export:" + ns + "/" + id }
