package allocators

import (
	"bufio"
	"bytes"
	"context"
	_ "embed"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"

	"github.com/containerd/errdefs"
)

//go:embed testdata/churn.c
var churnSource []byte

// Config is one allocator setup the churn program runs under.
type Config struct {
	Name string   // e.g. "jemalloc-decay0"
	Lib  string   // library linked in: "" (glibc), "jemalloc", "mimalloc"
	Env  []string // extra environment, e.g. MALLOC_CONF
}

// Configs are the setups every test and benchmark covers.
var Configs = []Config{
	{Name: "glibc"},
	{Name: "jemalloc", Lib: "jemalloc"},
	{Name: "jemalloc-decay0", Lib: "jemalloc", Env: []string{"MALLOC_CONF=dirty_decay_ms:0,muzzy_decay_ms:0"}},
	{Name: "mimalloc", Lib: "mimalloc"},
}

// Build compiles the churn program into dir once per library and returns
// the binaries by library ("" for glibc). jemalloc and mimalloc come from
// Debian's libjemalloc-dev and libmimalloc-dev.
func Build(ctx context.Context, dir string) (map[string]string, error) {
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return nil, err
	}
	src := filepath.Join(dir, "churn.c")
	if err := os.WriteFile(src, churnSource, 0o644); err != nil {
		return nil, err
	}
	bins := map[string]string{}
	for _, lib := range []string{"", "jemalloc", "mimalloc"} {
		name := "churn-glibc"
		args := []string{"-O2", "-Wall", "-pthread", "-o"}
		if lib != "" {
			name = "churn-" + lib
		}
		bin := filepath.Join(dir, name)
		args = append(args, bin, src)
		if lib != "" {
			args = append(args, "-l"+lib)
		}
		if out, err := exec.CommandContext(ctx, "gcc", args...).CombinedOutput(); err != nil {
			return nil, fmt.Errorf("gcc %s (install libjemalloc-dev libmimalloc-dev?): %w: %s", name, err, out)
		}
		bins[lib] = bin
	}
	return bins, nil
}

// Command is the command line and environment that run cfg's churn.
func Command(bins map[string]string, cfg Config, threads, mib, yieldUs int) ([]string, []string) {
	args := []string{bins[cfg.Lib], "-t", strconv.Itoa(threads), "-m", strconv.Itoa(mib)}
	if yieldUs > 0 {
		args = append(args, "-y", strconv.Itoa(yieldUs))
	}
	return args, append(os.Environ(), cfg.Env...)
}

// Status is one report line of the churn program (cumulative counts).
type Status struct {
	T, Ops, Callocs, BadCalloc, BadPattern uint64
}

// Failures is every integrity failure the program has seen.
func (s Status) Failures() uint64 { return s.BadCalloc + s.BadPattern }

// ParseStatus parses a "churn t=..." line.
func ParseStatus(line string) (Status, error) {
	f := strings.Fields(line)
	if len(f) < 6 || f[0] != "churn" || !strings.HasPrefix(f[1], "t=") {
		return Status{}, fmt.Errorf("not a churn status line: %q: %w", line, errdefs.ErrInvalidArgument)
	}
	var s Status
	dst := map[string]*uint64{"t": &s.T, "ops": &s.Ops, "callocs": &s.Callocs, "bad_calloc": &s.BadCalloc, "bad_pattern": &s.BadPattern}
	for _, kv := range f[1:] {
		k, v, _ := strings.Cut(kv, "=")
		p, ok := dst[k]
		if !ok {
			continue
		}
		n, err := strconv.ParseUint(v, 10, 64)
		if err != nil {
			return Status{}, fmt.Errorf("churn status %q: %w", line, errdefs.ErrInvalidArgument)
		}
		*p = n
	}
	return s, nil
}

// ReadStatus returns the first and the last complete status lines of a churn
// output file, and how many there were.
func ReadStatus(path string) (first, last Status, n int, err error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return first, last, 0, err
	}
	// A line still being written has no newline yet: leave it out.
	b = b[:bytes.LastIndexByte(b, '\n')+1]
	sc := bufio.NewScanner(bytes.NewReader(b))
	for sc.Scan() {
		s, perr := ParseStatus(sc.Text())
		if perr != nil {
			continue // "churn ready" and a torn last line
		}
		if n == 0 {
			first = s
		}
		last = s
		n++
	}
	return first, last, n, sc.Err()
}
