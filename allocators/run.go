package allocators

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"sync"
	"time"

	"github.com/lazyfork/lazyfork/internal/criurun"
	"github.com/lazyfork/lazyfork/internal/procfs"
	"github.com/lazyfork/lazyfork/memfile"
	"github.com/lazyfork/lazyfork/memfile/madvguard"
	"github.com/lazyfork/lazyfork/memfile/rehome"
)

// Prepare turns a fresh dump into the image forks restore from (the memfile
// rewrite and/or the madvise guard). gen is 1 for the dump of the original,
// 2 for the dump of a fork.
type Prepare func(ctx context.Context, imageDir string, gen int) error

// RunOptions describe one family: an original, Forks copies of it watched
// for Watch, then (if ForkOfFork) a copy of the first copy watched for
// WatchGrandchild.
type RunOptions struct {
	Config  Config
	Bins    map[string]string
	Dir     string // work directory (created)
	Prepare Prepare
	Forks   int
	Warmup  time.Duration // churn before the dump
	// Move, if set, is run on the running original after Warmup (e.g.
	// MovePrepare: its memory moves onto a memory file in place, as a
	// LazyFork container's at its first snapshot); it then churns another
	// Warmup on that memory before the dump.
	Move            func(ctx context.Context, pid int) error
	Watch           time.Duration
	ForkOfFork      bool
	WatchGrandchild time.Duration
	Threads, MiB    int
	YieldUs         int
	Keep            bool // leave processes running (caller kills Result.PIDs)
	// Supervise runs a madvguard supervisor (Zero mode) beside every copy;
	// the program must call madvguard.MaybeServe first thing.
	Supervise bool
	// Sample, if set, is called with every watched process at the end of
	// each watch (e.g. to read its memory).
	Sample func(role string, pid int)
}

// Copy is the outcome of one watched process.
type Copy struct {
	Role        string // "parent", "fork1".., "fork1.1"
	PID         int
	Out         string // its stdout
	First, Last Status
	Lines       int
	Filters     int // Seccomp_filters of its root at the end of the watch
	Sup         *madvguard.Stats
}

// Result is the outcome of a family run.
type Result struct {
	Copies []Copy
	PIDs   []int
}

// Run starts the original, dumps it, prepares the image, restores the forks
// and watches them. Processes are killed before Run returns unless Keep.
func Run(ctx context.Context, o RunOptions) (*Result, error) {
	if err := os.MkdirAll(o.Dir, 0o755); err != nil {
		return nil, err
	}
	if o.Threads == 0 {
		o.Threads = 2
	}
	if o.MiB == 0 {
		o.MiB = 64
	}
	args, env := Command(o.Bins, o.Config, o.Threads, o.MiB, o.YieldUs)
	res := &Result{}
	sups := map[int]*madvguard.Remote{}
	defer func() {
		for _, s := range sups {
			s.Close()
		}
		if !o.Keep {
			for _, p := range res.PIDs {
				criurun.Kill(p)
			}
		}
	}()
	pout := filepath.Join(o.Dir, "parent.out")
	// Own cwd: CRIU's parasite mounts /proc at "proc.crtools" in the dumped
	// task's cwd, so concurrent dumps of tasks sharing a cwd collide (EEXIST).
	w, err := criurun.Start(args, criurun.StartOptions{Stdout: pout, Env: env, Dir: o.Dir})
	if err != nil {
		return res, err
	}
	res.PIDs = append(res.PIDs, w.PID)
	if err := waitLines(ctx, pout, 1, 30*time.Second); err != nil {
		return res, err
	}
	sleep(ctx, o.Warmup)
	if o.Move != nil {
		if err := o.Move(ctx, w.PID); err != nil {
			return res, fmt.Errorf("move: %w", err)
		}
		sleep(ctx, o.Warmup)
	}

	img := filepath.Join(o.Dir, "img")
	if _, err := criurun.Dump(ctx, w.PID, img, criurun.DumpOptions{}); err != nil {
		return res, err
	}
	if o.Prepare != nil {
		if err := o.Prepare(ctx, img, 1); err != nil {
			return res, fmt.Errorf("prepare: %w", err)
		}
	}
	copies := []Copy{{Role: "parent", PID: w.PID, Out: pout}}
	for i := 1; i <= o.Forks; i++ {
		out := filepath.Join(o.Dir, fmt.Sprintf("fork%d.out", i))
		r, err := criurun.Restore(ctx, img, criurun.RestoreOptions{Stdout: out})
		if err != nil {
			return res, err
		}
		res.PIDs = append(res.PIDs, r.PID)
		copies = append(copies, Copy{Role: fmt.Sprintf("fork%d", i), PID: r.PID, Out: out})
		if o.Supervise {
			if sups[r.PID], err = madvguard.SpawnSupervisor(r.PID); err != nil {
				return res, err
			}
		}
	}
	sleep(ctx, o.Watch)
	for i := range copies {
		finish(&copies[i], o.Sample, sups[copies[i].PID])
	}
	if o.ForkOfFork && o.Forks > 0 {
		img2 := filepath.Join(o.Dir, "img2")
		sup := sups[copies[1].PID]
		if sup != nil {
			if err := sup.Detach(); err != nil {
				return res, err
			}
		}
		if _, err := criurun.Dump(ctx, copies[1].PID, img2, criurun.DumpOptions{}); err != nil {
			return res, err
		}
		if sup != nil {
			if err := sup.Attach(); err != nil {
				return res, err
			}
		}
		if o.Prepare != nil {
			if err := o.Prepare(ctx, img2, 2); err != nil {
				return res, fmt.Errorf("prepare fork of fork: %w", err)
			}
		}
		out := filepath.Join(o.Dir, "fork1.1.out")
		r, err := criurun.Restore(ctx, img2, criurun.RestoreOptions{Stdout: out})
		if err != nil {
			return res, err
		}
		res.PIDs = append(res.PIDs, r.PID)
		if o.Supervise {
			if sups[r.PID], err = madvguard.SpawnSupervisor(r.PID); err != nil {
				return res, err
			}
		}
		sleep(ctx, o.WatchGrandchild)
		g := Copy{Role: "fork1.1", PID: r.PID, Out: out}
		finish(&g, o.Sample, sups[r.PID])
		copies = append(copies, g)
	}
	res.Copies = copies
	return res, ctx.Err()
}

func finish(c *Copy, sample func(string, int), sup *madvguard.Remote) {
	c.First, c.Last, c.Lines, _ = ReadStatus(c.Out)
	c.Filters = seccompFilters(c.PID)
	if sup != nil {
		if st, err := sup.Stats(); err == nil {
			c.Sup = &st
		}
	}
	if sample != nil {
		sample(c.Role, c.PID)
	}
}

// Check returns an error naming every copy that failed a check, made no
// progress or did not run.
func (r *Result) Check() error {
	var errs []error
	for _, c := range r.Copies {
		switch {
		case c.Lines < 2:
			errs = append(errs, fmt.Errorf("%s (pid %d): %d status lines", c.Role, c.PID, c.Lines))
		case c.Last.Failures() > 0:
			errs = append(errs, fmt.Errorf("%s (pid %d): %d bad callocs, %d bad patterns in %d callocs (%d ops)",
				c.Role, c.PID, c.Last.BadCalloc, c.Last.BadPattern, c.Last.Callocs, c.Last.Ops))
		case c.Last.Ops <= c.First.Ops:
			errs = append(errs, fmt.Errorf("%s (pid %d): no progress (%d ops)", c.Role, c.PID, c.Last.Ops))
		}
	}
	return errors.Join(errs...)
}

func (c Copy) String() string {
	s := fmt.Sprintf("%s pid=%d lines=%d ops=%d callocs=%d bad_calloc=%d bad_pattern=%d filters=%d",
		c.Role, c.PID, c.Lines, c.Last.Ops-c.First.Ops, c.Last.Callocs-c.First.Callocs, c.Last.BadCalloc, c.Last.BadPattern, c.Filters)
	if c.Sup != nil {
		s += fmt.Sprintf(" zeroed=%d refused=%d", c.Sup.Zeroed, c.Sup.Refused)
	}
	return s
}

// MemfilePrepare rewrites each dump into memory files of family (plain
// processes: the files are mapped at their host paths) and, unless mode is
// nil, guards it in mode inside the rewrite (its Stage hook), so the guard
// lands atomically with the rewrite.
func MemfilePrepare(store *memfile.Store, family string, mode *madvguard.Mode) (Prepare, error) {
	famDir, err := store.FamilyDir(family)
	if err != nil {
		return nil, err
	}
	return func(ctx context.Context, dir string, gen int) error {
		opts := memfile.RewriteOptions{Family: family, MapDir: famDir, FileRoot: "/"}
		if mode != nil {
			opts.Stage = func(ctx context.Context, staging string) error {
				rs, err := madvguard.DataRanges(staging, famDir, famDir)
				if err != nil {
					return err
				}
				return madvguard.ApplyMode(staging, rs, *mode)
			}
		}
		_, err := store.Rewrite(ctx, dir, opts)
		return err
	}, nil
}

// MovePrepare moves a running process's private memory onto a new memory
// file of family in place, as the shim does with a container at its
// snapshot (memfile/rehome: seize, plan, copy and map, guard what moved in
// mode, detach); the file is mapped at its host path. The move runs in a
// re-execution of this binary (which must call MaybeServeMove first thing):
// the caller started the process and its exec.Cmd waits for it, and that
// wait would take the ptrace stops meant for the tracer.
func MovePrepare(store *memfile.Store, family string, mode madvguard.Mode) func(ctx context.Context, pid int) error {
	return func(ctx context.Context, pid int) (retErr error) {
		famDir, err := store.FamilyDir(family)
		if err != nil {
			return err
		}
		pf, err := store.CreateFile(family)
		if err != nil {
			return err
		}
		if err := pf.Publish(fmt.Sprintf("moved:allocators/%d/%s", pid, pf.Name())); err != nil {
			pf.Abort()
			return err
		}
		defer func() { retErr = errors.Join(retErr, pf.Seal()) }()
		req, err := json.Marshal(moveRequest{PID: pid, File: pf.Path(), MemDir: famDir, Mode: int(mode)})
		if err != nil {
			return err
		}
		self, err := os.Executable()
		if err != nil {
			return err
		}
		cmd := exec.CommandContext(ctx, self)
		cmd.Env = append(os.Environ(), moveEnv+"="+string(req))
		if out, err := cmd.CombinedOutput(); err != nil {
			return fmt.Errorf("move of %d: %w: %s", pid, err, out)
		}
		return nil
	}
}

const moveEnv = "LAZYFORK_ALLOCATORS_MOVE"

type moveRequest struct {
	PID    int    `json:"pid"`
	File   string `json:"file"`
	MemDir string `json:"memDir"`
	Mode   int    `json:"mode"`
}

// MaybeServeMove is MovePrepare's helper: in a process started by it, it
// moves and exits; otherwise it returns at once.
func MaybeServeMove() {
	v := os.Getenv(moveEnv)
	if v == "" {
		return
	}
	var req moveRequest
	err := json.Unmarshal([]byte(v), &req)
	if err == nil {
		err = move(req)
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	os.Exit(0)
}

func move(req moveRequest) (retErr error) {
	f, err := os.OpenFile(req.File, os.O_RDWR, 0)
	if err != nil {
		return err
	}
	defer f.Close()
	tr, err := rehome.Seize("", req.PID)
	if err != nil {
		return err
	}
	defer func() { retErr = errors.Join(retErr, tr.Detach()) }()
	vmas, err := rehome.PlanWith(req.PID, rehome.PlanOptions{MemDir: req.MemDir})
	if err != nil {
		return err
	}
	done, _, err := tr.MoveFile(req.PID, f, req.File, vmas, 0)
	if err != nil {
		return err
	}
	if len(done) == 0 {
		return fmt.Errorf("process %d: nothing moved (%d VMAs planned)", req.PID, len(vmas))
	}
	ranges := make([]madvguard.Range, len(done))
	for i, v := range done {
		ranges[i] = madvguard.Range{Start: v.Start, End: v.End}
	}
	prog, err := madvguard.Program(ranges, madvguard.Mode(req.Mode))
	if err != nil {
		return err
	}
	return tr.InstallFilter(req.PID, prog)
}

func seccompFilters(pid int) int {
	n, _ := procfs.SeccompFilters(pid)
	return n
}

func waitLines(ctx context.Context, path string, n int, timeout time.Duration) error {
	deadline := time.Now().Add(timeout)
	for time.Now().Before(deadline) && ctx.Err() == nil {
		if _, _, got, _ := ReadStatus(path); got >= n {
			return nil
		}
		time.Sleep(50 * time.Millisecond)
	}
	b, _ := os.ReadFile(path)
	return fmt.Errorf("%s: fewer than %d status lines after %v:\n%s", path, n, timeout, b)
}

func sleep(ctx context.Context, d time.Duration) {
	select {
	case <-ctx.Done():
	case <-time.After(d):
	}
}

// RunAll runs one family per option set at once and returns the results in
// the same order.
func RunAll(ctx context.Context, opts []RunOptions) ([]*Result, []error) {
	res := make([]*Result, len(opts))
	errs := make([]error, len(opts))
	var wg sync.WaitGroup
	for i := range opts {
		wg.Go(func() { res[i], errs[i] = Run(ctx, opts[i]) })
	}
	wg.Wait()
	return res, errs
}
