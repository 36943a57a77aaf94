package rehome

import (
	"bytes"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"time"

	"github.com/containerd/errdefs"
)

// setFreezer freezes or thaws the cgroup directory cg (v1: freezer.state;
// v2: cgroup.freeze) and waits until the kernel reports the new state.
func setFreezer(cg string, frozen bool) error {
	v1 := filepath.Join(cg, "freezer.state")
	if _, err := os.Stat(v1); err == nil {
		want := "THAWED"
		if frozen {
			want = "FROZEN"
		}
		for i := 0; ; i++ {
			// Writing FROZEN again is how a v1 freezer is nudged to
			// finish (CRIU does the same).
			if err := os.WriteFile(v1, []byte(want), 0); err != nil {
				return fmt.Errorf("rehome: cgroup %s: write %s: %w", cg, want, err)
			}
			b, err := os.ReadFile(v1)
			if err != nil {
				return fmt.Errorf("rehome: cgroup %s: %w", cg, err)
			}
			if string(bytes.TrimSpace(b)) == want {
				return nil
			}
			if i == 1000 {
				return fmt.Errorf("rehome: cgroup %s stays %s, not %s: %w", cg, bytes.TrimSpace(b), want, errdefs.ErrUnavailable)
			}
			time.Sleep(time.Millisecond)
		}
	}
	v2 := filepath.Join(cg, "cgroup.freeze")
	if _, err := os.Stat(v2); err != nil {
		return fmt.Errorf("rehome: %s is neither a cgroup v1 freezer nor a cgroup v2 directory: %w", cg, errors.Join(err, errdefs.ErrInvalidArgument))
	}
	val, want := "0", "frozen 0"
	if frozen {
		val, want = "1", "frozen 1"
	}
	if err := os.WriteFile(v2, []byte(val), 0); err != nil {
		return fmt.Errorf("rehome: cgroup %s: write cgroup.freeze=%s: %w", cg, val, err)
	}
	for i := 0; ; i++ {
		b, err := os.ReadFile(filepath.Join(cg, "cgroup.events"))
		if err != nil {
			return fmt.Errorf("rehome: cgroup %s: %w", cg, err)
		}
		if bytes.Contains(b, []byte(want)) {
			return nil
		}
		if i == 1000 {
			return fmt.Errorf("rehome: cgroup %s does not reach %q: %w", cg, want, errdefs.ErrUnavailable)
		}
		time.Sleep(time.Millisecond)
	}
}
