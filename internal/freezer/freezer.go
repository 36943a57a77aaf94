package freezer

import (
	"bytes"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"time"

	"github.com/containerd/errdefs"
)

// waitFor bounds how long Set waits for the kernel to report the state (a
// v1 freezer can stay FREEZING while a task sleeps uninterruptibly).
const waitFor = time.Second

// Set freezes (frozen) or thaws the cgroup directory cg and waits until the
// kernel reports that state; errdefs.ErrUnavailable if it does not within a
// second (the cgroup may then be FREEZING: the caller decides whether to
// thaw it). A first look comes at once, then every 100 µs for the first
// few milliseconds (a freeze is mostly done when the write returns), then
// every millisecond.
func Set(cg string, frozen bool) error {
	v1 := filepath.Join(cg, "freezer.state")
	if _, err := os.Stat(v1); err == nil {
		want := "THAWED"
		if frozen {
			want = "FROZEN"
		}
		return wait(cg, want, func() (bool, error) {
			// Writing FROZEN again is how a v1 freezer is nudged to
			// finish (CRIU and runc do the same).
			if err := os.WriteFile(v1, []byte(want), 0); err != nil {
				return false, fmt.Errorf("cgroup %s: write %s: %w", cg, want, err)
			}
			b, err := os.ReadFile(v1)
			if err != nil {
				return false, fmt.Errorf("cgroup %s: %w", cg, err)
			}
			return string(bytes.TrimSpace(b)) == want, nil
		})
	}
	v2 := filepath.Join(cg, "cgroup.freeze")
	if _, err := os.Stat(v2); err != nil {
		return fmt.Errorf("%s is neither a cgroup v1 freezer nor a cgroup v2 directory: %w", cg, errors.Join(err, errdefs.ErrInvalidArgument))
	}
	val, want := "0", "frozen 0"
	if frozen {
		val, want = "1", "frozen 1"
	}
	if err := os.WriteFile(v2, []byte(val), 0); err != nil {
		return fmt.Errorf("cgroup %s: write cgroup.freeze=%s: %w", cg, val, err)
	}
	return wait(cg, want, func() (bool, error) {
		b, err := os.ReadFile(filepath.Join(cg, "cgroup.events"))
		if err != nil {
			return false, fmt.Errorf("cgroup %s: %w", cg, err)
		}
		return bytes.Contains(b, []byte(want)), nil
	})
}

// State reads whether the cgroup directory cg is frozen (v1: FROZEN or
// FREEZING; v2: cgroup.freeze set).
func State(cg string) (frozen bool, err error) {
	if b, err := os.ReadFile(filepath.Join(cg, "freezer.state")); err == nil {
		return string(bytes.TrimSpace(b)) != "THAWED", nil
	}
	b, err := os.ReadFile(filepath.Join(cg, "cgroup.freeze"))
	if err != nil {
		return false, fmt.Errorf("cgroup %s: %w", cg, err)
	}
	return string(bytes.TrimSpace(b)) == "1", nil
}

// wait calls done until it reports true, fails, or waitFor has passed.
func wait(cg, want string, done func() (bool, error)) error {
	start := time.Now()
	for i := 0; ; i++ {
		ok, err := done()
		if err != nil || ok {
			return err
		}
		if time.Since(start) > waitFor {
			return fmt.Errorf("cgroup %s does not reach %s within %s: %w", cg, want, waitFor, errdefs.ErrUnavailable)
		}
		if i < 50 {
			time.Sleep(100 * time.Microsecond)
		} else {
			time.Sleep(time.Millisecond)
		}
	}
}
