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
