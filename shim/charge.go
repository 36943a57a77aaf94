package shim

import (
	"encoding/json"
	"os"
	"path/filepath"
	"time"

	"github.com/lazyfork/lazyfork/internal/procfs"
)

// FamilyRecord is what the shim reports about a family for the tools
// (ROOT/families/<family>.json): which memory cgroup its memory files are
// charged to. The kernel charges a tmpfs page to the memory cgroup of the
// process that first wrote it, and the files are written by the family's shim
// during the checkpoint rewrite; so the files belong to the shim's memory
// cgroup (containerd's, or runc's ShimCgroup option), never to the forks.
type FamilyRecord struct {
	Family       string    `json:"family"`
	MemoryCgroup string    `json:"memoryCgroup"`
	ShimPID      int       `json:"shimPid"`
	Updated      time.Time `json:"updated"`
}

// FamilyRecordPath is where the record of a family lives under a LazyFork root.
func FamilyRecordPath(root, family string) string {
	return filepath.Join(root, "families", family+".json")
}

// recordCharge writes the family's record after a rewrite.
func recordCharge(root, family string) error {
	rec := FamilyRecord{Family: family, MemoryCgroup: selfMemoryCgroup(), ShimPID: os.Getpid(), Updated: time.Now().UTC()}
	b, err := json.Marshal(&rec)
	if err != nil {
		return err
	}
	p := FamilyRecordPath(root, family)
	if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
		return err
	}
	return writeFileAtomic(p, b, 0o644)
}

// selfMemoryCgroup is this process's memory cgroup: the v1 memory hierarchy's
// path, or the unified one.
func selfMemoryCgroup() string {
	path, _, _ := procfs.Cgroup(os.Getpid(), "memory")
	return path
}
