package memfile

import (
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"time"

	"github.com/containerd/errdefs"
)

// SnapshotFile is the name of the file a rewrite adds to an image directory.
const SnapshotFile = "lazyfork.json"

// ThawFile names the file, beside an image directory, by which whoever paused
// a task asks the shim's checkpoint into imageDir to thaw the task as soon as
// CRIU's dump is done, before the rewrite: the task runs while its memory is
// written to the files. The shim writes the time it thawed the task
// (RFC 3339, nanoseconds) into the file. The asker creates it empty, calls
// Resume after the checkpoint as always (a no-op then), and removes it.
func ThawFile(imageDir string) string { return filepath.Clean(imageDir) + ".lazyfork-thaw" }

// SnapshotInfo describes a rewritten image (imageDir/lazyfork.json).
type SnapshotInfo struct {
	Family string `json:"family"`
	// Files are the family files (base names) the image maps: what it pins.
	Files []string `json:"files"`
	// Parent is the family file whose contents this snapshot's delta pages
	// sit on top of ("" for a snapshot that owns all its memory: a first
	// rewrite, or a rebase).
	Parent string `json:"parent,omitempty"`
	// Pages is the number of pages the image maps from family files.
	Pages uint64 `json:"pages"`
	// KeptPages is the number of pages left in the image (restored by CRIU
	// into each copy's private memory).
	KeptPages uint64 `json:"kept_pages"`
	// MapDir is the directory recorded in the image for the files.
	MapDir  string    `json:"map_dir"`
	Rebased bool      `json:"rebased,omitempty"`
	Created time.Time `json:"created"`
}

// ReadSnapshot reads imageDir/lazyfork.json. An image that was never
// rewritten gives an error wrapping errdefs.ErrNotFound.
func ReadSnapshot(imageDir string) (*SnapshotInfo, error) {
	p := filepath.Join(imageDir, SnapshotFile)
	b, err := os.ReadFile(p)
	if err != nil {
		if errors.Is(err, os.ErrNotExist) {
			return nil, fmt.Errorf("%s is not a LazyFork snapshot: %w", imageDir, errdefs.ErrNotFound)
		}
		return nil, err
	}
	var info SnapshotInfo
	if err := json.Unmarshal(b, &info); err != nil {
		return nil, fmt.Errorf("%s: %v: %w", p, err, errdefs.ErrDataLoss)
	}
	if checkFamily(info.Family) != nil {
		return nil, fmt.Errorf("%s: bad family %q: %w", p, info.Family, errdefs.ErrDataLoss)
	}
	return &info, nil
}
