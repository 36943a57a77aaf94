package workloads

import (
	"context"
	"fmt"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"syscall"

	"github.com/containerd/containerd/v2/client"

	"github.com/lazyfork/lazyfork/integration/harness"
)

// ImageDir is where the python test image holds these workloads.
const ImageDir = "/opt/lazyfork/workloads"

// CounterPath is counter.py inside the python test image.
const CounterPath = ImageDir + "/counter.py"

// CounterArgs is the process args of a counter holding heapMiB MiB.
func CounterArgs(heapMiB int) []string {
	return []string{"python3", CounterPath, strconv.Itoa(heapMiB)}
}

// SourceDir is the host directory of these workloads (for plain-process tests).
func SourceDir() string {
	_, file, _, _ := runtime.Caller(0)
	return filepath.Dir(file)
}

// ParseTick returns N for a line "tick N".
func ParseTick(line string) (int, bool) {
	s, ok := strings.CutPrefix(line, "tick ")
	if !ok {
		return 0, false
	}
	n, err := strconv.Atoi(strings.TrimSpace(s))
	return n, err == nil
}

// IsReady reports whether line is the counter's "ready ..." line.
func IsReady(line string) bool { return strings.HasPrefix(line, "ready ") }

// LastTick returns the highest tick in the log so far (0 if none).
func LastTick(logPath string) (int, error) {
	lines, err := harness.ReadLines(logPath)
	if err != nil {
		return 0, err
	}
	last := 0
	for _, l := range lines {
		if n, ok := ParseTick(l); ok && n > last {
			last = n
		}
	}
	return last, nil
}

// waitLine is harness.WaitLine that fails at once when the counter died with a
// Python traceback instead of waiting for a line that will never come.
func waitLine(ctx context.Context, logPath string, skip int, match func(string) bool) (string, error) {
	var died bool
	line, err := harness.WaitLine(ctx, logPath, skip, func(l string) bool {
		if strings.HasPrefix(l, "Traceback ") {
			died = true
			return true
		}
		return match(l)
	})
	if err == nil && died {
		lines, _ := harness.ReadLines(logPath)
		return "", fmt.Errorf("workloads: counter failed:\n%s", strings.Join(lines, "\n"))
	}
	return line, err
}

// FirstTick waits for the first tick in the log and returns it.
func FirstTick(ctx context.Context, logPath string) (int, error) {
	line, err := waitLine(ctx, logPath, 0, func(l string) bool { _, ok := ParseTick(l); return ok })
	if err != nil {
		return 0, err
	}
	n, _ := ParseTick(line)
	return n, nil
}

// WaitReady waits for the counter's ready line.
func WaitReady(ctx context.Context, logPath string) (string, error) {
	return waitLine(ctx, logPath, 0, IsReady)
}

// WaitTickAbove waits until the log shows a tick greater than n and returns it.
func WaitTickAbove(ctx context.Context, logPath string, n int) (int, error) {
	line, err := waitLine(ctx, logPath, 0, func(l string) bool { t, ok := ParseTick(l); return ok && t > n })
	if err != nil {
		return 0, err
	}
	t, _ := ParseTick(line)
	return t, nil
}

// Signaler is what can deliver a signal to a counter, e.g. a client.Task.
type Signaler interface {
	Kill(ctx context.Context, s syscall.Signal, opts ...client.KillOpts) error
}

// Verify sends SIGUSR1 and waits for the verify line that answers it. It returns
// the line and an error unless the counter reported "verify ok".
func Verify(ctx context.Context, p Signaler, logPath string) (string, error) {
	return signalAndWait(ctx, p, logPath, syscall.SIGUSR1, "verify ", "verify ok ")
}

// Write sends SIGUSR2 (write a marker into one page) and waits for "wrote ...".
func Write(ctx context.Context, p Signaler, logPath string) (string, error) {
	return signalAndWait(ctx, p, logPath, syscall.SIGUSR2, "wrote ", "wrote ")
}

func signalAndWait(ctx context.Context, p Signaler, logPath string, sig syscall.Signal, prefix, okPrefix string) (string, error) {
	lines, err := harness.ReadLines(logPath)
	if err != nil {
		return "", err
	}
	if err := p.Kill(ctx, sig); err != nil {
		return "", fmt.Errorf("workloads: signal %v: %w", sig, err)
	}
	line, err := waitLine(ctx, logPath, len(lines), func(l string) bool { return strings.HasPrefix(l, prefix) })
	if err != nil {
		return "", err
	}
	if !strings.HasPrefix(line, okPrefix) {
		return line, fmt.Errorf("workloads: %s", line)
	}
	return line, nil
}
