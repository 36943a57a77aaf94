package main

import (
	"context"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	containerd "github.com/containerd/containerd/v2/client"
	"github.com/containerd/containerd/v2/pkg/cio"
	"github.com/containerd/containerd/v2/pkg/oci"
	"golang.org/x/sys/unix"

	"github.com/lazyfork/lazyfork/api"
	"github.com/lazyfork/lazyfork/bench/internal/ctrbench"
	lfclient "github.com/lazyfork/lazyfork/client"
	"github.com/lazyfork/lazyfork/integration/harness"
	"github.com/lazyfork/lazyfork/integration/workloads"
	"github.com/lazyfork/lazyfork/internal/cgroupmem"
	"github.com/lazyfork/lazyfork/memfile"
)

const (
	modeMove     = "move"      // default: the parent moves onto its first snapshot's memory file, later ones are patched deltas; its writes are spread (worst case)
	modeMoveRun  = "move-run"  // the same, the parent writing one run of consecutive pages between calls
	modeMoveEach = "move-each" // lazyfork.io/rehome=each-snapshot: the parent moves at every snapshot (spread writes)
	modeOff      = "off"       // lazyfork.io/rehome=false: no move (spread writes)

	lazyforkRuntime = api.RuntimeName
	pageSize        = 4096
)

// modes are the series each heap size runs.
var modes = []string{modeMove, modeMoveRun, modeMoveEach, modeOff}

// writer is the parent: a python process holding HEAP_MIB MiB of non-zero
// pages (a bytearray) that prints "tick N" ten times a second and, on SIGUSR2,
// writes one byte into each of PAGES pages it has not written before and
// prints "wrote ...". PATTERN "spread" takes pages 7919 apart across the heap
// (every page its own island: the worst case for a move, which maps each
// island from the new file); "run" takes the next PAGES consecutive pages
// (what appending to a structure does). It speaks counter.py's protocol (ready,
// tick, wrote), so integration/workloads waits for it.
const writer = `
import os, signal, sys, time
mib, npw, pattern = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
pending = []
signal.signal(signal.SIGUSR2, lambda s, f: pending.append(s))
signal.signal(signal.SIGTERM, lambda s, f: sys.exit(0))
P = 4096
heap = bytearray(mib << 20)
chunk = bytes(range(1, 256)) * 4112
chunk = chunk[:1 << 20]
for off in range(0, len(heap), 1 << 20):
    heap[off:off + (1 << 20)] = chunk
npages = len(heap) // P
print("ready heap_mib=%d pages=%d pid=%d" % (mib, npages, os.getpid()), flush=True)
w = 0
k = 0
t = 0
while True:
    while pending:
        pending.pop()
        w += 1
        for _ in range(npw):
            k += 1
            i = (k * 7919) % npages if pattern == "spread" else k % npages
            heap[i * P + 8] = (heap[i * P + 8] + 1) & 255
        print("wrote writes=%d pages=%d" % (w, npw), flush=True)
    t += 1
    print("tick %d" % t, flush=True)
    time.sleep(0.1)
`

func writerArgs(heapMiB, pages int, pattern string) []string {
	return []string{"python3", "-c", writer, strconv.Itoa(heapMiB), strconv.Itoa(pages), pattern}
}

// pattern is how a mode's parent writes between calls.
func pattern(mode string) string {
	if mode == modeMoveRun {
		return "run"
	}
	return "spread"
}

type bench struct {
	cfg      config
	env      *ctrbench.Env
	h        *harness.Containerd
	root     string // LAZYFORK_ROOT (the shim mounts a tmpfs there)
	plainDir string // a tmpfs for the plain runc checkpoints
	lf       *lfclient.Client
	r        *results
	seq      int
}

func newBench(bin string, cfg config) (_ *bench, retErr error) {
	b := &bench{cfg: cfg, r: &results{plain: map[int][]plainRun{}, first: map[int][]time.Duration{}}}
	defer func() {
		if retErr != nil {
			b.close()
		}
	}()
	var err error
	if b.plainDir, err = os.MkdirTemp("/tmp", "lfb-plain-"); err != nil {
		return nil, err
	}
	if err := memfile.EnsureTmpfs(b.plainDir, 0); err != nil {
		return nil, err
	}
	if b.env, b.lf, err = ctrbench.SetupLazyForkWith(context.Background(), bin, harness.Options{Env: b.cfg.stackEnv}); err != nil {
		return nil, err
	}
	b.h, b.root = b.env.H, b.env.Root
	return b, nil
}

func (b *bench) close() {
	if b.env != nil {
		if err := b.env.Close(); err != nil {
			fmt.Fprintln(os.Stderr, "bench-refork: teardown:", err)
		}
	}
	if b.plainDir != "" {
		_ = unix.Unmount(b.plainDir, unix.MNT_DETACH)
		os.RemoveAll(b.plainDir)
	}
}

func (b *bench) id(prefix string) string {
	b.seq++
	return fmt.Sprintf("%s-%d", prefix, b.seq)
}

func (b *bench) logIO() lfclient.ForkOpt {
	return lfclient.WithIO(func(id string) cio.Creator { return cio.LogFile(b.h.TaskLogPath(id)) })
}

// start starts a writer container holding heapMiB on runtime, filled and ticking.
func (b *bench) start(ctx context.Context, id, runtime string, heapMiB int, pattern string, annotations map[string]string) (*ctrbench.Counter, error) {
	ctx, cancel := context.WithTimeout(ctx, 6*time.Minute)
	defer cancel()
	cfg := harness.ContainerConfig{Runtime: runtime, Args: writerArgs(heapMiB, b.cfg.writePages, pattern)}
	if len(annotations) > 0 {
		cfg.SpecOpts = []oci.SpecOpts{oci.WithAnnotations(annotations)}
	}
	return b.env.StartCounter(ctx, id, heapMiB, cfg)
}

// remove deletes tasks and containers (with snapshots), a few at a time,
// ignoring what is gone.
func (b *bench) remove(ctx context.Context, ctrs ...containerd.Container) {
	ctx = b.h.Context(ctx)
	sem := make(chan struct{}, 8)
	var wg sync.WaitGroup
	for _, c := range ctrs {
		if c == nil {
			continue
		}
		wg.Add(1)
		sem <- struct{}{}
		go func() {
			defer func() { <-sem; wg.Done() }()
			if t, err := c.Task(ctx, nil); err == nil {
				_, _ = t.Delete(ctx, containerd.WithProcessKill)
			}
			_ = c.Delete(ctx, containerd.WithSnapshotCleanup)
		}()
	}
	wg.Wait()
}

// cgroupPath is a container's linux.cgroupsPath (forks are not made by the
// harness, so it comes from the spec).
func (b *bench) cgroupPath(ctx context.Context, ctr containerd.Container) (string, error) {
	spec, err := ctr.Spec(b.h.Context(ctx))
	if err != nil {
		return "", err
	}
	return spec.Linux.CgroupsPath, nil
}

// plain times leave-running checkpoints of an identical container under
// runc (pause -> checkpoint -> resume, as bench/fork's plain side), into a
// tmpfs like LazyFork's snapshots, alternating with first snapshots of fresh
// LazyFork parents (firstSnapshot): the two are compared in one stretch of
// the run, sample for sample, not one run against a median taken earlier.
func (b *bench) plain(ctx context.Context, heapMiB int) error {
	ctx = b.h.Context(ctx)
	parent, err := b.start(ctx, b.id(fmt.Sprintf("pl%d", heapMiB)), harness.RuncRuntime, heapMiB, "spread", nil)
	if parent != nil {
		defer b.remove(context.WithoutCancel(ctx), parent.Container)
	}
	if err != nil {
		return err
	}
	for i := 0; i < max(b.cfg.plainRuns, b.cfg.firstRuns); i++ {
		if i < b.cfg.plainRuns {
			dir, err := os.MkdirTemp(b.plainDir, "ckpt-")
			if err != nil {
				return err
			}
			paused, err := ctrbench.PausedCheckpoint(ctx, b.h.Client(), parent, dir)
			if err != nil {
				os.RemoveAll(dir)
				return err
			}
			total, _, _ := ctrbench.ImageSize(dir)
			os.RemoveAll(dir)
			b.r.plain[heapMiB] = append(b.r.plain[heapMiB], plainRun{paused, total})
			if _, err := workloads.Write(ctx, parent.Task, parent.Log); err != nil {
				return err
			}
		}
		if i < b.cfg.firstRuns {
			paused, err := b.firstSnapshot(ctx, heapMiB, i)
			if err != nil {
				return fmt.Errorf("first snapshot %d: %w", i+1, err)
			}
			b.r.first[heapMiB] = append(b.r.first[heapMiB], paused)
		}
	}
	return nil
}

// firstSnapshot starts a fresh LazyFork parent, forks it once (its first
// snapshot: the move onto its memory file and a dump) and removes it all,
// returning the parent's pause.
func (b *bench) firstSnapshot(ctx context.Context, heapMiB, i int) (time.Duration, error) {
	parent, err := b.start(ctx, b.id(fmt.Sprintf("first%d-%d", heapMiB, i)), lazyforkRuntime, heapMiB, pattern(modeMoveRun), nil)
	made := []containerd.Container{}
	defer func() { b.remove(context.WithoutCancel(ctx), made...) }()
	if parent != nil {
		made = append(made, parent.Container)
	}
	if err != nil {
		return 0, err
	}
	t0 := time.Now()
	res, err := b.lf.Fork(ctx, parent.ID, 1, b.logIO())
	wall := time.Since(t0)
	if res != nil {
		for _, f := range res.Forks {
			made = append(made, f.Container)
		}
	}
	if err != nil {
		return 0, err
	}
	// The wall is the user's too: a precopy before the freeze shortens
	// the pause and lengthens the call.
	fmt.Fprintf(os.Stderr, "  first snapshot %d: paused %7.1f ms  wall %7.1f ms\n", i+1, res.Paused.Seconds()*1000, wall.Seconds()*1000)
	if b.cfg.breakdown {
		fmt.Fprintf(os.Stderr, "    %s\n", b.phases(parent.ID))
	}
	return res.Paused, nil
}

// series runs cfg.calls successive one-fork calls on one parent in mode, the
// parent writing cfg.writePages pages between calls, then (for the total
// heaps) cfg.totalForks forks at once; it frees everything before returning.
func (b *bench) series(ctx context.Context, heapMiB int, mode string) error {
	ctx = b.h.Context(ctx)
	var ann map[string]string
	switch mode {
	case modeOff:
		ann = map[string]string{api.AnnotationRehome: "false"}
	case modeMoveEach:
		ann = map[string]string{api.AnnotationRehome: api.RehomeEachSnapshot}
	}
	parent, err := b.start(ctx, b.id(fmt.Sprintf("%s%d", mode, heapMiB)), lazyforkRuntime, heapMiB, pattern(mode), ann)
	var made []containerd.Container
	defer func() { b.remove(context.WithoutCancel(ctx), made...) }()
	if parent != nil {
		made = append(made, parent.Container)
	}
	if err != nil {
		return err
	}
	pcg, err := b.cgroupPath(ctx, parent.Container)
	if err != nil {
		return err
	}
	pid := int(parent.Task.Pid())
	memDir := filepath.Join(b.root, "mem")
	before := parentMem(pcg, pid)
	b.r.calls = append(b.r.calls, call{heap: heapMiB, mode: mode, index: 0, parent: before})

	var snaps []string
	var family string
	defer func() {
		for _, s := range snaps {
			_ = b.lf.RemoveSnapshot(context.WithoutCancel(ctx), s)
		}
	}()
	for i := 1; i <= b.cfg.calls; i++ {
		c := call{heap: heapMiB, mode: mode, index: i}
		if i > 1 {
			if _, err := workloads.Write(ctx, parent.Task, parent.Log); err != nil {
				return fmt.Errorf("write before call %d: %w", i, err)
			}
			c.written = int64(b.cfg.writePages) * pageSize
			// What the process itself dirtied since its last move: its
			// private pages now less those it kept through the move (the
			// interpreter writes pages of its own besides the heap's).
			c.dirtied = parentMem(pcg, pid).rssAnon - b.r.calls[len(b.r.calls)-1].parent.rssAnon
		}
		moves0 := b.moves(parent.ID)
		du0 := tmpfsBytes(memDir)
		stopPeak := tmpfsPeak(memDir)
		t0 := time.Now()
		res, err := b.lf.Fork(ctx, parent.ID, 1, lfclient.KeepSnapshot(), b.logIO())
		c.wall = time.Since(t0)
		c.tmpfsPeak = stopPeak()
		if err != nil && isRestoreFailure(err) {
			// A fork that failed to restore leaves the parent running and
			// nothing behind: the series goes on, the failure is reported
			// (CRIU 4.1.1 crashes now and then on a task past 256 file
			// mappings: memfile/premap.go).
			fmt.Fprintf(os.Stderr, "  call %2d: FAILED: %v\n", i, err)
			b.r.failed = append(b.r.failed, fmt.Sprintf("%d MiB %s call %d: %v", heapMiB, mode, i, err))
			continue
		}
		if err != nil {
			return fmt.Errorf("call %d: %w", i, err)
		}
		family = res.Family
		made = append(made, res.Forks[0].Container)
		c.tmpfsAdded = tmpfsBytes(memDir) - du0
		c.paused, c.checkpoint, c.restore = res.Paused, res.Checkpoint, res.Forks[0].Restore
		c.image, c.imagePages, _ = ctrbench.ImageSize(res.Snapshot)
		if err := b.lf.RemoveSnapshot(ctx, res.Snapshot); err != nil {
			snaps = append(snaps, res.Snapshot)
		}
		if ms := b.moves(parent.ID); len(ms) > len(moves0) {
			c.moved = ms[len(ms)-1]
		}
		c.parent = parentMem(pcg, pid)
		if b.cfg.breakdown {
			fmt.Fprintf(os.Stderr, "  call %2d phases: %s\n", i, b.phases(parent.ID))
			time.Sleep(time.Second)
			if fcg, err := b.cgroupPath(ctx, res.Forks[0].Container); err == nil {
				fpid := 0
				if t, err := res.Forks[0].Container.Task(ctx, nil); err == nil {
					fpid = int(t.Pid())
				}
				fmt.Fprintf(os.Stderr, "  call %2d fork:   %s\n", i, memBreakdown(fcg, fpid))
			}
			fmt.Fprintf(os.Stderr, "  call %2d parent: %s\n", i, memBreakdown(pcg, pid))
		}
		if !b.cfg.keepForks {
			b.remove(ctx, res.Forks[0].Container)
			made = made[:len(made)-1]
		}
		b.r.calls = append(b.r.calls, c)
		fmt.Fprintf(os.Stderr, "  call %2d: paused %7.1f ms  wall %7.1f ms (checkpoint %.0f, restore %.0f)  tmpfs +%8.2f MB (peak +%.2f)  image %8.2f MB  parent cgroup %7.2f MB anon %7.2f MB  moved %.2f MB in %v\n",
			i, c.paused.Seconds()*1000, c.wall.Seconds()*1000, c.checkpoint.Seconds()*1000, c.restore.Seconds()*1000, float64(c.tmpfsAdded)/1e6, float64(c.tmpfsPeak)/1e6, float64(c.image)/1e6,
			float64(c.parent.cgroup)/1e6, float64(c.parent.rssAnon)/1e6, float64(c.moved.bytes)/1e6, c.moved.dur)
	}
	if !slices.Contains(b.cfg.totalHeaps, heapMiB) || b.cfg.totalForks < 1 {
		return nil
	}

	// Parent + totalForks forks at once: what they cost the host in all.
	t := total{heap: heapMiB, mode: mode, forks: b.cfg.totalForks, family: family}
	t0 := time.Now()
	res, err := b.lf.Fork(ctx, parent.ID, b.cfg.totalForks)
	t.wall = time.Since(t0)
	if res != nil {
		for _, f := range res.Forks {
			made = append(made, f.Container)
		}
	}
	if err != nil {
		return fmt.Errorf("%d forks at once: %w", b.cfg.totalForks, err)
	}
	t.paused = res.Paused
	// Twice: 2 s after the forks (what they cost while the shims still hold
	// the batch's garbage) and settled, after the shims' heap trim has run.
	for _, wait := range []time.Duration{2 * time.Second, settleAfter} {
		time.Sleep(time.Until(t0.Add(t.wall + wait)))
		t.after = wait
		s, err := b.sampleTotal(ctx, t, pcg, pid, memDir, res.Forks)
		if err != nil {
			return err
		}
		b.r.totals = append(b.r.totals, s)
	}
	return nil
}

// settleAfter is when the settled sample is taken: past the shims' heap trim
// (2 s after their last restore), with room to spare.
const settleAfter = 8 * time.Second

// sampleTotal measures parent + forks in all, now.
func (b *bench) sampleTotal(ctx context.Context, t total, pcg string, pid int, memDir string, forks []lfclient.Fork) (total, error) {
	t.parent = parentMem(pcg, pid)
	for _, f := range forks {
		p, err := b.cgroupPath(ctx, f.Container)
		if err != nil {
			return t, err
		}
		m := cgroupMem(p)
		t.forksCgroup += m.cgroup
		t.forksShmem += m.shmem
	}
	t.tmpfs = tmpfsBytes(memDir)
	var shims []string
	for _, pid := range harness.ShimPIDs(b.env.H.Address) {
		m, err := ctrbench.ReadProcMemory(pid)
		if err != nil {
			continue // exited meanwhile
		}
		t.nShims++
		t.shimPss += m.Pss
		shims = append(shims, fmt.Sprintf("    shim %d: rss %.1f MB, private anonymous %.1f MB, pss %.1f MB\n", pid, float64(m.RSS)/1e6, float64(m.RssAnon)/1e6, float64(m.Pss)/1e6))
	}
	fmt.Fprintf(os.Stderr, "  %d forks, %.0f s after: parent %.1f MB + forks %.1f MB + tmpfs %.1f MB + shims %.1f MB = %.1f MB, %.1f MB counting charged files once\n",
		t.forks, t.after.Seconds(), float64(t.parent.cgroup)/1e6, float64(t.forksCgroup)/1e6, float64(t.tmpfs)/1e6, float64(t.shimPss)/1e6,
		float64(t.sum())/1e6, float64(t.dedup())/1e6)
	for _, line := range shims {
		fmt.Fprint(os.Stderr, line)
	}
	return t, nil
}

var moveRE = regexp.MustCompile(`bytes=(\d+) .*duration=("?)([0-9.]+[a-zµ]+)`)

// moves lists the shim's "moved onto memory file" log lines for container id.
func (b *bench) moves(id string) []move {
	var out []move
	for _, l := range strings.Split(b.h.Log(), "\n") {
		if !strings.Contains(l, "moved onto memory file") || !strings.Contains(l, "id="+id+" ") {
			continue
		}
		m := moveRE.FindStringSubmatch(l)
		if m == nil {
			out = append(out, move{})
			continue
		}
		n, _ := strconv.ParseInt(m[1], 10, 64)
		d, _ := time.ParseDuration(m[3])
		out = append(out, move{n, d})
	}
	return out
}

// tmpfsPeak samples the used bytes of the file system holding dir every
// 2 ms until the returned func is called, which returns the most they
// grew meanwhile: what a call held at its peak (a consolidation holds the
// heap twice until it frees the old pieces), beyond what it left.
func tmpfsPeak(dir string) func() int64 {
	used := func() int64 {
		var st unix.Statfs_t
		if unix.Statfs(dir, &st) != nil {
			return 0
		}
		return int64(st.Blocks-st.Bfree) * st.Bsize
	}
	base, peak := used(), int64(0)
	done, stopped := make(chan struct{}), make(chan struct{})
	go func() {
		defer close(stopped)
		t := time.NewTicker(2 * time.Millisecond)
		defer t.Stop()
		for {
			peak = max(peak, used()-base)
			select {
			case <-done:
				return
			case <-t.C:
			}
		}
	}()
	return func() int64 {
		close(done)
		<-stopped
		return max(peak, used()-base)
	}
}

// tmpfsBytes is what the files under dir occupy (st_blocks*512, each inode
// once), leaving out directories whose names start with a dot (.views holds
// links to the families' files, .state their records).
func tmpfsBytes(dir string) int64 {
	var n int64
	seen := map[uint64]bool{}
	_ = filepath.WalkDir(dir, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return nil
		}
		if d.IsDir() {
			if p != dir && strings.HasPrefix(d.Name(), ".") {
				return filepath.SkipDir
			}
			return nil
		}
		var st unix.Stat_t
		if unix.Lstat(p, &st) == nil && !seen[st.Ino] {
			seen[st.Ino] = true
			n += st.Blocks * 512
		}
		return nil
	})
	return n
}

// parentMem reads the parent's cgroup figures and its process's RssAnon.
func parentMem(cgroupsPath string, pid int) memSample {
	m := cgroupMem(cgroupsPath)
	if pm, err := ctrbench.ReadProcMemory(pid); err == nil {
		m.rssAnon = pm.RssAnon
	}
	return m
}

// cgroupMem reads a cgroup's usage and, from memory.stat, its anonymous and
// shmem (tmpfs: memory files charged to it) bytes; cgroup v1 or v2.
func cgroupMem(p string) memSample {
	var m memSample
	m.cgroup, _ = cgroupmem.Usage(p)
	if st, err := cgroupmem.Stat(p); err == nil {
		m.anon = st["anon"] + st["rss"] // v2, v1
		m.shmem = st["shmem"]
	}
	return m
}

// isRestoreFailure reports whether a fork call failed restoring its fork
// (the parent's snapshot was taken; the client removed what it made).
func isRestoreFailure(err error) bool {
	return strings.Contains(err.Error(), ": restore: ")
}
