package memfile

import (
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"

	"github.com/containerd/errdefs"

	"github.com/lazyfork/lazyfork/api"
)

// SnapshotFile is the name of the file a rewrite adds to an image directory.
const SnapshotFile = api.SnapshotFile

// ThawFile names the file, beside an image directory, by which whoever paused
// a task asks the shim's checkpoint into imageDir to thaw the task as soon as
// CRIU's dump is done, before the rewrite: the task runs while its memory is
// written to the files. The shim writes the time it thawed the task
// (RFC 3339, nanoseconds) into the file. The asker creates it empty, calls
// Resume after the checkpoint as always (a no-op then), and removes it.
func ThawFile(imageDir string) string { return filepath.Clean(imageDir) + ".lazyfork-thaw" }

// SnapshotInfo describes a rewritten image (imageDir/SnapshotFile).
type SnapshotInfo = api.SnapshotInfo

// ReadSnapshot reads imageDir/SnapshotFile. An image that was never
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
