package shim

import (
	"encoding/json"
	"os"
	"path/filepath"
	"time"

	"github.com/lazyfork/lazyfork/api"
	"github.com/lazyfork/lazyfork/internal/procfs"
)

// recordCharge writes the family's record after a rewrite.
func recordCharge(root, family string) error {
	rec := api.FamilyRecord{Family: family, MemoryCgroup: selfMemoryCgroup(), ShimPID: os.Getpid(), Updated: time.Now().UTC()}
	b, err := json.Marshal(&rec)
	if err != nil {
		return err
	}
	p := api.Root(root).FamilyRecord(family)
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
