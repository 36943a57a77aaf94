package main

import (
	"errors"
	"fmt"
	"path/filepath"
	"strings"
)

// sweepLogs removes the log files in the namespace's log directory whose
// container is gone: removed by another tool (ctr c rm, nerdctl rm) that
// knows nothing of lazyfork's logs. With dry it only names them.
func (a *app) sweepLogs(dry bool) ([]string, error) {
	dir := a.logDirNS()
	// The directory is read before the containers are listed: a log file
	// is made after its container, so a file seen here whose container is
	// not listed after is an orphan.
	names, err := a.lf.Node().LogFiles(a.ctx, dir)
	if err != nil {
		return nil, fmt.Errorf("logs in %s: %w", dir, err)
	}
	ctrs, err := a.cd.Containers(a.ctx)
	if err != nil {
		return nil, err
	}
	live := map[string]bool{}
	for _, c := range ctrs {
		live[c.ID()] = true
	}
	var removed []string
	var errs []error
	for _, name := range names {
		id, ok := strings.CutSuffix(name, ".log")
		if !ok || live[id] {
			continue
		}
		p := filepath.Join(dir, name)
		if !dry {
			if err := a.lf.Node().RemoveLog(a.ctx, p); err != nil {
				errs = append(errs, err)
				continue
			}
		}
		removed = append(removed, p)
	}
	return removed, errors.Join(errs...)
}

// logDirNS is the directory of the namespace's logs (logPath's).
func (a *app) logDirNS() string { return filepath.Dir(a.logPath("x")) }
