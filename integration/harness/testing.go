package harness

import (
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// StartT starts a private containerd for t and registers its teardown with
// t.Cleanup. When t has failed, containerd's log is printed first. A failure to
// start fails t (the caller gates the test with testutil.RequiresRoot & co).
func StartT(t testing.TB, opts Options) *Containerd {
	t.Helper()
	c, err := Start(context.Background(), opts)
	if err != nil {
		t.Fatalf("harness: %v", err)
	}
	t.Cleanup(func() {
		if t.Failed() {
			t.Logf("containerd log (%s):\n%s", c.LogPath, c.Log())
			c.logTaskLogs(t)
		}
		if err := c.Stop(); err != nil {
			t.Errorf("harness teardown: %v", err)
		}
	})
	return c
}

// logTaskLogs prints the last lines of every task log (NewTask's log files).
func (c *Containerd) logTaskLogs(t testing.TB) {
	ents, err := os.ReadDir(filepath.Join(c.Dir, "logs"))
	if err != nil {
		return
	}
	for _, e := range ents {
		p := filepath.Join(c.Dir, "logs", e.Name())
		lines, err := ReadLines(p)
		if err != nil {
			continue
		}
		if len(lines) > 30 {
			lines = lines[len(lines)-30:]
		}
		t.Logf("task log %s (last %d lines):\n%s", e.Name(), len(lines), strings.Join(lines, "\n"))
	}
}
