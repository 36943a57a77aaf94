package workloads

import (
	"context"
	_ "embed"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"

	"github.com/containerd/errdefs"
)

//go:embed cheap/cheap.c
var cSource []byte

//go:embed pyheap.py
var pySource []byte

//go:embed goheap/main.go
var goSource []byte

// Kind names a workload program.
type Kind string

const (
	C      Kind = "c"      // cheap.c, glibc malloc
	Python Kind = "python" // pyheap.py, threads and a child process
	Go     Kind = "go"     // goheap, debug.FreeOSMemory every tick
)

// Kinds lists every workload.
var Kinds = []Kind{C, Python, Go}

// Command builds the workload kind into dir (created if missing) and returns the
// command line that runs it with a heap of heapMiB and a tick of tickMs.
func Command(ctx context.Context, kind Kind, dir string, heapMiB, tickMs int) ([]string, error) {
	return CommandWith(ctx, kind, dir, Options{HeapMiB: heapMiB, TickMs: tickMs})
}

// Options shape a workload's command line.
type Options struct {
	HeapMiB int
	TickMs  int
	// Quiet (C only, for benchmarks): no threads, no churn; each tick reads a few
	// dozen random heap pages and writes one page.
	Quiet bool
}

// CommandWith is Command with every option.
func CommandWith(ctx context.Context, kind Kind, dir string, o Options) ([]string, error) {
	heapMiB, tickMs := o.HeapMiB, o.TickMs
	if o.Quiet && kind != C {
		return nil, fmt.Errorf("quiet mode exists for the c workload only: %w", errdefs.ErrInvalidArgument)
	}
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return nil, err
	}
	m, t := strconv.Itoa(heapMiB), strconv.Itoa(tickMs)
	switch kind {
	case C:
		p, err := BuildC(ctx, dir)
		if err != nil {
			return nil, err
		}
		if o.Quiet {
			return []string{p, "-q", "-m", m, "-t", t}, nil
		}
		return []string{p, "-m", m, "-t", t}, nil
	case Go:
		p, err := BuildGo(ctx, dir)
		if err != nil {
			return nil, err
		}
		return []string{p, "-m", m, "-t", t}, nil
	case Python:
		py, err := Python3()
		if err != nil {
			return nil, err
		}
		p := filepath.Join(dir, "pyheap.py")
		if err := os.WriteFile(p, pySource, 0o644); err != nil {
			return nil, err
		}
		return []string{py, p, m, t}, nil
	}
	return nil, fmt.Errorf("unknown workload %q (want c, python or go): %w", kind, errdefs.ErrInvalidArgument)
}

// Env returns the environment a workload runs with in copies that carry no
// madvise guard: the caller's, plus for Go GODEBUG=madvdontneed=0.
//
// Why: since Go 1.26 the runtime on Linux treats memory it gave back with a
// successful MADV_DONTNEED as zero when it reuses it (mheap.initSpan skips clearing
// scavenged pages unless needZeroAfterSysUnused). In a LazyFork copy that memory is
// a private file mapping, where MADV_DONTNEED brings back the file's bytes: fresh
// allocations then hold stale data. With madvdontneed=0 the runtime zeroes reused
// memory itself. With madvguard's filter in the snapshot the setting is not needed:
// the purge fails, and the runtime falls back to an anonymous mmap(MAP_FIXED),
// which does read zeros.
func Env(kind Kind) []string {
	env := os.Environ()
	if kind == Go {
		env = append(env, GoSafeGODEBUG)
	}
	return env
}

// GoSafeGODEBUG is the setting a Go program needs to run correctly in LazyFork
// copies (see Env).
const GoSafeGODEBUG = "GODEBUG=madvdontneed=0"

// BuildC compiles cheap.c with gcc into dir and returns the binary's path.
func BuildC(ctx context.Context, dir string) (string, error) {
	src := filepath.Join(dir, "cheap.c")
	bin := filepath.Join(dir, "cheap")
	if err := os.WriteFile(src, cSource, 0o644); err != nil {
		return "", err
	}
	out, err := exec.CommandContext(ctx, "gcc", "-O2", "-Wall", "-pthread", "-o", bin, src).CombinedOutput()
	if err != nil {
		return "", fmt.Errorf("gcc cheap.c: %w: %s", err, out)
	}
	return bin, nil
}

// BuildGo builds goheap with the go tool into dir and returns the binary's path.
func BuildGo(ctx context.Context, dir string) (string, error) {
	src := filepath.Join(dir, "goheap-src")
	if err := os.MkdirAll(src, 0o755); err != nil {
		return "", err
	}
	if err := os.WriteFile(filepath.Join(src, "main.go"), goSource, 0o644); err != nil {
		return "", err
	}
	if err := os.WriteFile(filepath.Join(src, "go.mod"), []byte("module goheap\n\ngo 1.22\n"), 0o644); err != nil {
		return "", err
	}
	goBin, err := exec.LookPath("go")
	if err != nil {
		goBin = "/usr/local/go/bin/go"
	}
	bin := filepath.Join(dir, "goheap")
	cmd := exec.CommandContext(ctx, goBin, "build", "-o", bin, ".")
	cmd.Dir = src
	cmd.Env = append(os.Environ(), "GOWORK=off", "GOFLAGS=", "GOTOOLCHAIN=local", "CGO_ENABLED=0")
	if out, err := cmd.CombinedOutput(); err != nil {
		return "", fmt.Errorf("go build goheap: %w: %s", err, out)
	}
	return bin, nil
}

// Python3 returns the system python3 (/usr/bin/python3 first: a pyenv shim is a
// shell script, which would add a process to every dump).
func Python3() (string, error) {
	if _, err := os.Stat("/usr/bin/python3"); err == nil {
		return "/usr/bin/python3", nil
	}
	p, err := exec.LookPath("python3")
	if err != nil {
		return "", fmt.Errorf("python3: %w", errdefs.ErrNotFound)
	}
	return p, nil
}
