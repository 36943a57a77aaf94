package workloads

import (
	"context"
	"fmt"
	"os"
	"strconv"
	"strings"
	"time"

	"golang.org/x/sys/unix"
)

// Output is the stdout file of a running workload (or of a restored copy).
type Output string

// Lines returns the complete lines written so far (a half-written last line is left out).
func (o Output) Lines() []string {
	b, _ := os.ReadFile(string(o))
	s := string(b)
	if i := strings.LastIndexByte(s, '\n'); i >= 0 {
		s = s[:i]
	} else {
		return nil
	}
	return strings.Split(s, "\n")
}

// Ticks returns the first and last tick numbers printed so far (0, 0 if none).
func (o Output) Ticks() (first, last uint64) {
	for _, l := range o.Lines() {
		if n, ok := tickOf(l); ok {
			if first == 0 {
				first = n
			}
			last = n
		}
	}
	return first, last
}

func tickOf(line string) (uint64, bool) {
	f := strings.Fields(line)
	if len(f) < 2 || f[0] != "tick" {
		return 0, false
	}
	n, err := strconv.ParseUint(f[1], 10, 64)
	return n, err == nil
}

// Report is a parsed "verify", "child-verify" or "marker" line.
type Report struct {
	Line   string
	Fields map[string]string
}

// OK reports whether a verify line says ok=1.
func (r *Report) OK() bool { return r.Fields["ok"] == "1" }

// Uint returns a numeric field (0 if absent).
func (r *Report) Uint(name string) uint64 {
	n, _ := strconv.ParseUint(r.Fields[name], 10, 64)
	return n
}

func parse(line string) *Report {
	r := &Report{Line: line, Fields: map[string]string{}}
	for _, f := range strings.Fields(line)[1:] {
		if k, v, ok := strings.Cut(f, "="); ok {
			r.Fields[k] = v
		}
	}
	return r
}

// Reports returns every line that starts with word ("verify", "marker", ...).
func (o Output) Reports(word string) []*Report {
	var out []*Report
	for _, l := range o.Lines() {
		if strings.HasPrefix(l, word+" ") {
			out = append(out, parse(l))
		}
	}
	return out
}

// WaitTicks waits until the workload has printed a tick >= n.
func (o Output) WaitTicks(ctx context.Context, n uint64) error {
	return poll(ctx, func() bool { _, last := o.Ticks(); return last >= n },
		func() string { return fmt.Sprintf("tick %d in %s", n, o) })
}

// Ask sends sig to pid and waits for the next line starting with word.
func (o Output) Ask(ctx context.Context, pid int, sig unix.Signal, word string) (*Report, error) {
	before := len(o.Reports(word))
	if err := unix.Kill(pid, sig); err != nil {
		return nil, fmt.Errorf("signal %d: %w", pid, err)
	}
	var r *Report
	err := poll(ctx, func() bool {
		rs := o.Reports(word)
		if len(rs) > before {
			r = rs[before]
			return true
		}
		return false
	}, func() string { return fmt.Sprintf("a %q line in %s after signal %v to %d", word, o, sig, pid) })
	return r, err
}

// Verify asks the workload to check all its memory (SIGUSR1) and returns its verify line.
func (o Output) Verify(ctx context.Context, pid int) (*Report, error) {
	return o.Ask(ctx, pid, unix.SIGUSR1, "verify")
}

// Mark asks the workload to write a new marker into its heap (SIGUSR2) and returns it.
func (o Output) Mark(ctx context.Context, pid int) (uint64, error) {
	r, err := o.Ask(ctx, pid, unix.SIGUSR2, "marker")
	if err != nil {
		return 0, err
	}
	return r.Uint("value"), nil
}

// WaitReports waits until at least n lines start with word.
func (o Output) WaitReports(ctx context.Context, word string, n int) ([]*Report, error) {
	var rs []*Report
	err := poll(ctx, func() bool { rs = o.Reports(word); return len(rs) >= n },
		func() string { return fmt.Sprintf("%d %q lines in %s", n, word, o) })
	return rs, err
}

// WaitLimit bounds every wait of this package: a workload answers in well under a
// second, so a minute means it is gone or stuck.
const WaitLimit = time.Minute

func poll(ctx context.Context, cond func() bool, what func() string) error {
	ctx, cancel := context.WithTimeout(ctx, WaitLimit)
	defer cancel()
	for !cond() {
		select {
		case <-ctx.Done():
			return fmt.Errorf("waiting for %s: %w", what(), ctx.Err())
		case <-time.After(20 * time.Millisecond):
		}
	}
	return nil
}
