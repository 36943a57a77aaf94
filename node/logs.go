//go:build linux

package node

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"
	"sync/atomic"
	"time"

	"github.com/containerd/errdefs"
)

// logPath checks that a log path is absolute (it is the node's).
func logPath(p string) (string, error) {
	if !filepath.IsAbs(p) {
		return "", fmt.Errorf("log path %q is not absolute: %w", p, errdefs.ErrInvalidArgument)
	}
	return filepath.Clean(p), nil
}

// PrepareLog makes the directory of log file path.
func (l *Local) PrepareLog(_ context.Context, path string) error {
	p, err := logPath(path)
	if err != nil {
		return err
	}
	return os.MkdirAll(filepath.Dir(p), 0o755)
}

// RemoveLog removes log file path (a missing one is fine).
func (l *Local) RemoveLog(_ context.Context, path string) error {
	p, err := logPath(path)
	if err != nil {
		return err
	}
	fi, err := os.Lstat(p)
	if errors.Is(err, os.ErrNotExist) {
		return nil
	}
	if err != nil {
		return err
	}
	// A log is a regular file named *.log: nothing else is removed through
	// this call, whatever path a container's label gives.
	if !fi.Mode().IsRegular() || !strings.HasSuffix(p, ".log") {
		return fmt.Errorf("%s is not a log file (a regular *.log file): %w", p, errdefs.ErrInvalidArgument)
	}
	if err := os.Remove(p); err != nil && !errors.Is(err, os.ErrNotExist) {
		return err
	}
	return nil
}

// LogFiles lists the regular files of dir.
func (l *Local) LogFiles(_ context.Context, dir string) ([]string, error) {
	d, err := logPath(dir)
	if err != nil {
		return nil, err
	}
	ents, err := os.ReadDir(d)
	if errors.Is(err, os.ErrNotExist) {
		return nil, nil
	}
	if err != nil {
		return nil, fmt.Errorf("logs in %s: %w", d, err)
	}
	var names []string
	for _, e := range ents {
		if e.Type().IsRegular() {
			names = append(names, e.Name())
		}
	}
	return names, nil
}

// StatLog tells whether path exists and is a fifo.
func (l *Local) StatLog(_ context.Context, path string) (bool, bool, error) {
	p, err := logPath(path)
	if err != nil {
		return false, false, err
	}
	fi, err := os.Stat(p)
	if errors.Is(err, os.ErrNotExist) {
		return false, false, nil
	}
	if err != nil {
		return false, false, err
	}
	return true, fi.Mode()&os.ModeNamedPipe != 0, nil
}

// ReadLog reads log file path (see Node.ReadLog).
func (l *Local) ReadLog(ctx context.Context, path string, follow bool) (LogReader, error) {
	p, err := logPath(path)
	if err != nil {
		return nil, err
	}
	r := &tailReader{ctx: ctx, path: p, follow: follow}
	if !follow {
		if r.f, err = os.Open(p); err != nil {
			return nil, fmt.Errorf("log %s: %w", p, notFound(err))
		}
	}
	return r, nil
}

func notFound(err error) error {
	if errors.Is(err, os.ErrNotExist) {
		return fmt.Errorf("%w: %w", err, errdefs.ErrNotFound)
	}
	return err
}

// tailReader reads a file; with follow, at its end it polls for more until
// finished or ctx ends.
type tailReader struct {
	ctx      context.Context
	path     string
	follow   bool
	f        *os.File
	finished atomic.Bool
}

// pollInterval is how often a follow looks for more output.
const pollInterval = 100 * time.Millisecond

func (r *tailReader) Finish() { r.finished.Store(true) }

func (r *tailReader) wait() bool {
	select {
	case <-r.ctx.Done():
		return false
	case <-time.After(pollInterval):
		return true
	}
}

func (r *tailReader) Read(b []byte) (int, error) {
	for r.f == nil {
		// Not written yet (a task just created): wait for it.
		f, err := os.Open(r.path)
		if err == nil {
			r.f = f
			break
		}
		if !errors.Is(err, os.ErrNotExist) {
			return 0, fmt.Errorf("log %s: %w", r.path, err)
		}
		if r.finished.Load() {
			return 0, fmt.Errorf("log %s: %w (the container ended without writing it)", r.path, notFound(err))
		}
		if !r.wait() {
			return 0, io.EOF
		}
	}
	for {
		// Read once more after Finish: output written before the end is
		// not lost.
		fin := r.finished.Load()
		n, err := r.f.Read(b)
		if n > 0 || err != io.EOF {
			return n, err
		}
		if !r.follow || fin {
			return 0, io.EOF
		}
		if !r.wait() {
			return 0, io.EOF
		}
	}
}

func (r *tailReader) Close() error {
	if r.f != nil {
		return r.f.Close()
	}
	return nil
}
