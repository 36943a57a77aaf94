package harness

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strings"

	"github.com/lazyfork/lazyfork/internal/procfs"
)

// ownerFile records which process owns a harness dir: "PID STARTTIME", the start
// time (field 22 of /proc/PID/stat) telling a live owner from a reused PID.
const ownerFile = "owner"

func selfIdentity() string {
	return processIdentity(os.Getpid())
}

func processIdentity(pid int) string {
	st, err := procfs.ReadStat(pid)
	if err != nil {
		return ""
	}
	return fmt.Sprintf("%d %d", pid, st.StartTime)
}

// ownerAlive reports whether the process that started the harness in dir still runs.
func ownerAlive(dir string) bool {
	b, err := os.ReadFile(filepath.Join(dir, ownerFile))
	if err != nil {
		// No owner file yet: a harness being created right now, or not ours.
		return true
	}
	var pid int
	if _, err := fmt.Sscanf(string(b), "%d", &pid); err != nil {
		return true
	}
	return processIdentity(pid) == strings.TrimSpace(string(b))
}

// ReapOrphans reaps the harness dirs under base (default: where Start puts them)
// whose owning process has died without tearing down: a test killed by a
// timeout, a panic, SIGKILL. Start calls it, so leftovers of a crashed run are
// gone by the next one. Harnesses of live processes are never touched.
func ReapOrphans(ctx context.Context, base string) []error {
	if base == "" {
		base = baseDir()
	}
	dirs, _ := filepath.Glob(filepath.Join(base, "lfh-*-*"))
	var errs []error
	for _, d := range dirs {
		if st, err := os.Stat(d); err != nil || !st.IsDir() {
			continue
		}
		if ownerAlive(d) {
			continue
		}
		if err := Reap(ctx, d); err != nil {
			errs = append(errs, err)
		}
	}
	return errs
}

// baseDir is the parent of harness dirs: $TMPDIR when short, else /tmp (socket
// paths must stay short).
func baseDir() string {
	base := os.TempDir()
	if len(base) > 20 {
		base = "/tmp"
	}
	return base
}
