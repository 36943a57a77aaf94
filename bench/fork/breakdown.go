package main

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"time"

	containerd "github.com/containerd/containerd/v2/client"
	"github.com/containerd/containerd/v2/core/mount"
	"github.com/containerd/containerd/v2/pkg/cio"

	"github.com/lazyfork/lazyfork/bench/internal/ctrbench"
	"github.com/lazyfork/lazyfork/bench/internal/report"
	lfclient "github.com/lazyfork/lazyfork/client"
	"github.com/lazyfork/lazyfork/integration/harness"
)

// The breakdown of one fork's restore, phase by phase, from the logs a fork
// leaves: containerd's debug log (the shim's lines included), CRIU's
// restore.log (debug level: relative timestamps, anchored at the file's
// modification time, which is its last line's) and the client's own clock.
// It runs in a containerd of its own (debug log, CRIU at verbosity 4), so the
// logging does not touch the other figures; the logging costs a little, so
// the breakdown's total is a little above restore_1.

// phase is one step of a fork's restore.
type phase struct {
	name string
	d    time.Duration
}

// forkTrace is what the logs say about one fork.
type forkTrace struct {
	phases   []phase
	total    time.Duration
	restore  time.Duration // the client's task create -> running
	kdat     string        // "loaded" or "probed"
	tmpfs    int           // tmpfs mounts whose contents CRIU untarred
	tmpfsDur time.Duration
}

// breakdownPhases names the phases, in order.
var breakdownPhases = []string{
	"client: rootfs, container record, task create",
	"shim start (containerd runs `shim start`)",
	"shim Create (prepare, rootfs mount)",
	"containerd/client: create -> start",
	"runc restore -> CRIU logs (runc, version check, CRIU start)",
	"CRIU: configuration, kernel-feature probes",
	"CRIU: cgroups, task, namespaces",
	"CRIU: mounts (tmpfs contents: CRIU runs tar)",
	"CRIU: files, memory mappings",
	"CRIU: restorer, resume",
	"runc exit, runc shim's start bookkeeping",
	"shim: restored task's cgroup, OOM watch",
	"containerd, client",
}

var (
	logTimeRE = regexp.MustCompile(`^time="([^"]+)"`)
	logMsgRE  = regexp.MustCompile(`msg="([^"]*)"`)
	logIDRE   = regexp.MustCompile(` id=([^ ]+)`)
	restoreRE = regexp.MustCompile(` restore=([0-9.]+[a-zµ]+)`)
	criuTSRE  = regexp.MustCompile(`^\((\d+)\.(\d+)\)`)
)

// containerdMarks finds, in containerd's log from offset, the times of id's
// task create, shim connection, shim Create and restore end, and the restore's
// duration as the shim measured it.
func containerdMarks(logPath string, offset int64, id string) (map[string]time.Time, time.Duration, error) {
	f, err := os.Open(logPath)
	if err != nil {
		return nil, 0, err
	}
	defer f.Close()
	if _, err := f.Seek(offset, io.SeekStart); err != nil {
		return nil, 0, err
	}
	marks := map[string]time.Time{}
	var restore time.Duration
	sc := bufio.NewScanner(f)
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	for sc.Scan() {
		line := sc.Text()
		tm, msg := logTimeRE.FindStringSubmatch(line), logMsgRE.FindStringSubmatch(line)
		if tm == nil || msg == nil {
			continue
		}
		t, err := time.Parse(time.RFC3339Nano, tm[1])
		if err != nil {
			continue
		}
		idm := logIDRE.FindStringSubmatch(line)
		lineID := ""
		if idm != nil {
			lineID = strings.Trim(idm[1], `"`)
		}
		var key string
		switch {
		case msg[1] == "creating task" && lineID == id:
			key = "create"
		case msg[1] == "connecting to shim "+id:
			key = "shim"
		case msg[1] == "lazyfork: created" && lineID == id:
			key = "created"
		case msg[1] == "lazyfork: started" && lineID == id:
			key = "started"
		case msg[1] == "lazyfork: restored" && lineID == id:
			key = "restored"
			if m := restoreRE.FindStringSubmatch(line); m != nil {
				restore, _ = time.ParseDuration(m[1])
			}
		}
		if key != "" {
			if _, seen := marks[key]; !seen {
				marks[key] = t
			}
		}
	}
	for _, k := range []string{"create", "shim", "created", "restored"} {
		if _, ok := marks[k]; !ok {
			return nil, 0, fmt.Errorf("containerd's log has no %q line for %s (is it at debug level?)", k, id)
		}
	}
	if _, ok := marks["started"]; !ok {
		marks["started"] = marks["restored"] // a shim from before the line: its share shows in the next phase
	}
	return marks, restore, sc.Err()
}

// criuMarks reads CRIU's restore log: the offsets from CRIU's start of its
// phase boundaries, its end, the kerndat cache's use, and the tmpfs contents.
func criuMarks(b []byte) (marks map[string]time.Duration, end time.Duration, kdat string, tmpfs int, tmpfsDur time.Duration) {
	marks = map[string]time.Duration{}
	kdat = "probed"
	var lastTmpfs time.Duration = -1
	sc := bufio.NewScanner(bytes.NewReader(b))
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	for sc.Scan() {
		line := sc.Text()
		m := criuTSRE.FindStringSubmatch(line)
		if m == nil {
			continue
		}
		sec, _ := strconv.Atoi(m[1])
		us, _ := strconv.Atoi(m[2])
		t := time.Duration(sec)*time.Second + time.Duration(us)*time.Microsecond
		if lastTmpfs >= 0 {
			// The time from "Mounting tmpfs" to the next line is the mount
			// and, for a tmpfs with contents, CRIU's tar run (the proxy, or tar+gzip).
			if d := t - lastTmpfs; d > 300*time.Microsecond {
				tmpfs++
				tmpfsDur += d
			}
			lastTmpfs = -1
		}
		set := func(k string) {
			if _, ok := marks[k]; !ok {
				marks[k] = t
			}
		}
		switch {
		case strings.Contains(line, "Loaded kdat cache"):
			kdat = "loaded"
		case strings.Contains(line, "cg: Preparing cgroups yard"), strings.Contains(line, "cg: cgroud: Daemon started"):
			// The yard only where CRIU manages cgroups (LazyFork's
			// configuration has it ignore them); the daemon either way.
			set("probed")
		case strings.Contains(line, "mnt: Restoring mount namespace"):
			set("ns")
		case strings.Contains(line, "Running post-setup-namespaces scripts"):
			set("mounts")
		case strings.Contains(line, "Switched to the restorer"):
			set("files")
		case strings.Contains(line, "Mounting tmpfs @"):
			lastTmpfs = t
		}
		end = t
	}
	return marks, end, kdat, tmpfs, tmpfsDur
}

// errCRIULogTiming: the inotify events of a fork's restore log came too late
// to place CRIU (read together after CRIU ended).
var errCRIULogTiming = errors.New("its inotify events came late")

// traceFork restores one fork of snapshot and returns its breakdown.
func traceFork(ctx context.Context, env *ctrbench.Env, lf *lfclient.Client, logs *criuLogWatch, parentID, snapshot string) (*forkTrace, error) {
	h := env.H
	off := fileSize(h.LogPath)
	logIO := lfclient.WithIO(func(id string) cio.Creator { return cio.LogFile(h.TaskLogPath(id)) })
	t0 := time.Now()
	forks, err := lf.RestoreForks(ctx, parentID, snapshot, 1, logIO)
	t1 := time.Now()
	if err != nil {
		return nil, err
	}
	ctr := forks[0].Container
	defer func() {
		ctx := h.Context(context.WithoutCancel(ctx))
		if t, err := ctr.Task(ctx, nil); err == nil {
			_, _ = t.Delete(ctx, containerd.WithProcessKill)
		}
		_ = ctr.Delete(ctx, containerd.WithSnapshotCleanup)
	}()
	id := ctr.ID()
	rl := filepath.Join(h.State, "io.containerd.runtime.v2.task", h.Namespace, id, "work", "restore.log")
	rb, err := os.ReadFile(rl)
	if err != nil {
		return nil, err
	}
	// containerd writes its log lines a moment after the event.
	time.Sleep(100 * time.Millisecond)
	cm, restore, err := containerdMarks(h.LogPath, off, id)
	if err != nil {
		return nil, err
	}
	crm, end, kdat, ntmpfs, tmpfsDur := criuMarks(rb)
	for _, k := range []string{"probed", "ns", "mounts", "files"} {
		if _, ok := crm[k]; !ok {
			return nil, fmt.Errorf("CRIU's restore log %s has no %q mark (is CRIU at verbosity 4?)", rl, k)
		}
	}
	criuStart, criuExit, err := logs.times(id)
	if err != nil {
		return nil, err
	}
	if span := criuExit.Sub(criuStart); span < end {
		return nil, fmt.Errorf("%s: CRIU's log spans %v but was seen open only %v: %w", rl, end, span, errCRIULogTiming)
	}
	startBegin := cm["restored"].Add(-restore)
	at := []time.Time{
		t0, cm["create"], cm["shim"], cm["created"], startBegin, criuStart,
		criuStart.Add(crm["probed"]), criuStart.Add(crm["ns"]), criuStart.Add(crm["mounts"]),
		criuStart.Add(crm["files"]), criuExit, cm["restored"], cm["started"], t1,
	}
	tr := &forkTrace{total: t1.Sub(t0), restore: forks[0].Restore, kdat: kdat, tmpfs: ntmpfs, tmpfsDur: tmpfsDur}
	for i, name := range breakdownPhases {
		tr.phases = append(tr.phases, phase{name, at[i+1].Sub(at[i])})
	}
	return tr, nil
}

// breakdown is the phases of n forks of one snapshot (medians, worst).
type breakdown struct {
	n        int
	median   []time.Duration
	worst    []time.Duration
	totals   []time.Duration
	restores []time.Duration
	kdat     string
	fresh    *freshBreakdown
	tmpfs    int
	tmpfsDur []time.Duration
}

// runBreakdown starts its own debug-logging containerd, a 64 MiB counter, a
// first fork (which starts the batch's shim) and then n single forks of the
// same snapshot, each traced.
func runBreakdown(ctx context.Context, bin string, n int) (*breakdown, error) {
	env, lf, err := ctrbench.SetupLazyForkWith(ctx, bin, harness.Options{Debug: true, Env: []string{"LAZYFORK_CRIU_VERBOSITY=4"}}, clientOpts...)
	if err != nil {
		return nil, err
	}
	defer env.Close()
	ctx = env.H.Context(ctx)
	sctx, cancel := context.WithTimeout(ctx, 6*time.Minute)
	defer cancel()
	parent, err := env.StartCounter(sctx, "bd-parent", 64, harness.ContainerConfig{Runtime: "io.containerd.lazyfork.v1"})
	if err != nil {
		return nil, err
	}
	res, err := lf.Fork(ctx, parent.ID, 1, lfclient.KeepSnapshot(),
		lfclient.WithIO(func(id string) cio.Creator { return cio.LogFile(env.H.TaskLogPath(id)) }))
	if err != nil {
		return nil, err
	}
	defer lf.RemoveSnapshot(context.WithoutCancel(ctx), res.Snapshot)
	bd := &breakdown{n: n}
	if bd.fresh, err = traceFresh(ctx, env, n); err != nil {
		return nil, fmt.Errorf("fresh starts: %w", err)
	}
	logs, err := watchCRIULogs(filepath.Join(env.H.Root, "io.containerd.runtime.v2.task", env.H.Namespace))
	if err != nil {
		return nil, err
	}
	defer logs.close()
	var traces []*forkTrace
	for missed := 0; len(traces) < n; {
		tr, err := traceFork(ctx, env, lf, logs, parent.ID, res.Snapshot)
		if errors.Is(err, errCRIULogTiming) && missed < n {
			// The watch was late (a busy host): another fork instead.
			missed++
			fmt.Fprintf(os.Stderr, "breakdown: %v; tracing another fork\n", err)
			continue
		}
		if err != nil {
			return nil, err
		}
		traces = append(traces, tr)
		bd.totals = append(bd.totals, tr.total)
		bd.restores = append(bd.restores, tr.restore)
		bd.tmpfsDur = append(bd.tmpfsDur, tr.tmpfsDur)
		bd.kdat, bd.tmpfs = tr.kdat, tr.tmpfs
	}
	for i := range breakdownPhases {
		var ds []time.Duration
		for _, tr := range traces {
			ds = append(ds, tr.phases[i].d)
		}
		bd.median = append(bd.median, report.Median(ds))
		bd.worst = append(bd.worst, report.Max(ds))
	}
	return bd, nil
}

// print writes the breakdown beside the floors.
func (bd *breakdown) print(w io.Writer, fl *floors) {
	ms := func(d time.Duration) string { return fmt.Sprintf("%6.1f", float64(d.Microseconds())/1000) }
	fmt.Fprintf(w, "\none fork's restore, phase by phase (a fork of a 64 MiB counter whose batch shim runs; %d forks; ms; debug logs on):\n", bd.n)
	fmt.Fprintf(w, "  %-60s %6s %6s\n", "phase", "median", "worst")
	for i, name := range breakdownPhases {
		fmt.Fprintf(w, "  %-60s %s %s\n", name, ms(bd.median[i]), ms(bd.worst[i]))
	}
	fmt.Fprintf(w, "  %-60s %s %s\n", "total (the client's fork call)", ms(report.Median(bd.totals)), ms(report.Max(bd.totals)))
	fmt.Fprintf(w, "  %-60s %s %s\n", "of which restore (task create -> running, as restore_1)", ms(report.Median(bd.restores)), ms(report.Max(bd.restores)))
	fmt.Fprintf(w, "  CRIU's kernel-feature cache: %s; tmpfs contents extracted (CRIU's tar run, the proxy answering unless LAZYFORK_CRIU_PROXY=off): %d mounts, %s ms (median)\n",
		bd.kdat, bd.tmpfs, strings.TrimSpace(ms(report.Median(bd.tmpfsDur))))
	if bd.fresh != nil {
		bd.fresh.print(w)
	}
	if fl != nil {
		fl.print(w)
	}
}

// floors are what starting a container costs without LazyFork, measured in
// the benchmark's containerd.
type floors struct {
	runcRun   []time.Duration // `runc run` of busybox `true` (create, start, exit, delete)
	runcV2    []time.Duration // task create -> running of a fresh busybox, io.containerd.runc.v2
	lazyforkF []time.Duration // the same on io.containerd.lazyfork.v1
}

func (fl *floors) print(w io.Writer) {
	ms := func(ds []time.Duration) string {
		return fmt.Sprintf("median %.1f, worst %.1f", float64(report.Median(ds).Microseconds())/1000, float64(report.Max(ds).Microseconds())/1000)
	}
	fmt.Fprintf(w, "floors (ms, %d runs each, same run):\n", len(fl.runcV2))
	fmt.Fprintf(w, "  runc run (busybox true: create, start, exit, delete)       %s\n", ms(fl.runcRun))
	fmt.Fprintf(w, "  runc.v2 task start of a fresh busybox (create -> running)   %s\n", ms(fl.runcV2))
	fmt.Fprintf(w, "  lazyfork.v1 task start of a fresh busybox                   %s\n", ms(fl.lazyforkF))
}

// measureFloors times n fresh busybox task starts on each runtime
// (alternating) and n `runc run` of busybox's true on the same rootfs.
func measureFloors(ctx context.Context, env *ctrbench.Env, n int) (*floors, error) {
	h := env.H
	ctx = h.Context(ctx)
	img, err := h.ImportImage(ctx, "busybox")
	if err != nil {
		return nil, err
	}
	fl := &floors{}
	start := func(id, runtime string) (time.Duration, error) {
		ctr, err := h.NewContainer(ctx, id, harness.ContainerConfig{Image: img, Runtime: runtime, Args: []string{"sleep", "3600"}})
		if err != nil {
			return 0, err
		}
		defer func() {
			ctx := context.WithoutCancel(ctx)
			if t, err := ctr.Task(ctx, nil); err == nil {
				_, _ = t.Delete(ctx, containerd.WithProcessKill)
			}
			_ = ctr.Delete(ctx, containerd.WithSnapshotCleanup)
		}()
		t0 := time.Now()
		if _, err := h.StartTask(ctx, ctr); err != nil {
			return 0, err
		}
		return time.Since(t0), nil
	}
	// One of each first: the first start of a runtime loads its binaries.
	for i := range n + 1 {
		for _, rt := range []string{harness.RuncRuntime, "io.containerd.lazyfork.v1"} {
			d, err := start(fmt.Sprintf("floor-%d-%s", i, strings.Split(rt, ".")[2]), rt)
			if err != nil {
				return nil, err
			}
			if i == 0 {
				continue
			}
			if rt == harness.RuncRuntime {
				fl.runcV2 = append(fl.runcV2, d)
			} else {
				fl.lazyforkF = append(fl.lazyforkF, d)
			}
		}
	}
	runs, err := runcRunTrue(ctx, h, img, n)
	if err != nil {
		return nil, err
	}
	fl.runcRun = runs
	return fl, nil
}

// runcRunTrue times n `runc run` of busybox's true in a bundle on a snapshot
// of img.
func runcRunTrue(ctx context.Context, h *harness.Containerd, img containerd.Image, n int) ([]time.Duration, error) {
	ctr, err := h.NewContainer(ctx, "floor-runc-run", harness.ContainerConfig{Image: img, Args: []string{"true"}})
	if err != nil {
		return nil, err
	}
	defer ctr.Delete(context.WithoutCancel(ctx), containerd.WithSnapshotCleanup)
	info, err := ctr.Info(ctx)
	if err != nil {
		return nil, err
	}
	mounts, err := h.Client().SnapshotService(info.Snapshotter).Mounts(ctx, info.SnapshotKey)
	if err != nil {
		return nil, err
	}
	bundle, err := h.TempDir("runc-run-")
	if err != nil {
		return nil, err
	}
	defer os.RemoveAll(bundle)
	rootfs := filepath.Join(bundle, "rootfs")
	if err := os.MkdirAll(rootfs, 0o755); err != nil {
		return nil, err
	}
	if err := mount.All(mounts, rootfs); err != nil {
		return nil, err
	}
	defer mount.UnmountAll(rootfs, 0)
	if out, err := runCmd(bundle, "runc", "spec"); err != nil {
		return nil, fmt.Errorf("runc spec: %v: %s", err, out)
	}
	cfgPath := filepath.Join(bundle, "config.json")
	b, err := os.ReadFile(cfgPath)
	if err != nil {
		return nil, err
	}
	b = bytes.Replace(b, []byte(`"terminal": true`), []byte(`"terminal": false`), 1)
	b = bytes.Replace(b, []byte(`"sh"`), []byte(`"true"`), 1)
	if err := os.WriteFile(cfgPath, b, 0o644); err != nil {
		return nil, err
	}
	root := filepath.Join(bundle, "runc-root")
	var ds []time.Duration
	for i := range n + 1 {
		t0 := time.Now()
		if out, err := runCmd(bundle, "runc", "--root", root, "run", "--bundle", bundle, fmt.Sprintf("lf-floor-%d", i)); err != nil {
			return nil, fmt.Errorf("runc run: %v: %s", err, out)
		}
		if i > 0 {
			ds = append(ds, time.Since(t0))
		}
	}
	return ds, nil
}

func fileSize(p string) int64 {
	st, err := os.Stat(p)
	if err != nil {
		return 0
	}
	return st.Size()
}

// runCmd runs name in dir and returns its combined output.
func runCmd(dir, name string, args ...string) ([]byte, error) {
	cmd := exec.Command(name, args...)
	cmd.Dir = dir
	return cmd.CombinedOutput()
}

// freshPhases names the phases of a fresh task's start.
var freshPhases = []string{
	"client -> containerd task create",
	"shim start (containerd runs `shim start`, the shim serves)",
	"task create (the shim's Create: runc create, hooks)",
	"task start (runc start)",
}

// freshBreakdown is, per runtime, the phases of fresh busybox starts
// (medians), and for lazyfork.v1 its prepare and runc create (the shim's own
// figures, medians).
type freshBreakdown struct {
	runtimes  []string
	median    map[string][]time.Duration
	totals    map[string][]time.Duration
	prepare   []time.Duration
	runcCreat []time.Duration
}

var (
	prepareRE    = regexp.MustCompile(` prepare=([0-9.]+[a-zµ]+)`)
	runcCreateRE = regexp.MustCompile(` runc_create=([0-9.]+[a-zµ]+)`)
)

// traceFresh starts n fresh busybox tasks on each runtime (alternating, after
// one warm-up each) in env's debug-logging containerd and splits them.
func traceFresh(ctx context.Context, env *ctrbench.Env, n int) (*freshBreakdown, error) {
	h := env.H
	img, err := h.ImportImage(ctx, "busybox")
	if err != nil {
		return nil, err
	}
	fb := &freshBreakdown{runtimes: []string{harness.RuncRuntime, "io.containerd.lazyfork.v1"},
		median: map[string][]time.Duration{}, totals: map[string][]time.Duration{}}
	per := map[string][][]time.Duration{}
	for i := range n + 1 {
		for _, rt := range fb.runtimes {
			id := fmt.Sprintf("fresh-%d-%s", i, strings.Split(rt, ".")[2])
			ctr, err := h.NewContainer(ctx, id, harness.ContainerConfig{Image: img, Runtime: rt, Args: []string{"sleep", "3600"}})
			if err != nil {
				return nil, err
			}
			off := fileSize(h.LogPath)
			t0 := time.Now()
			task, err := h.NewTask(ctx, ctr)
			t1 := time.Now()
			if err == nil {
				err = task.Start(ctx)
			}
			t2 := time.Now()
			if err != nil {
				return nil, err
			}
			_, _ = task.Delete(ctx, containerd.WithProcessKill)
			_ = ctr.Delete(ctx, containerd.WithSnapshotCleanup)
			if i == 0 {
				continue
			}
			time.Sleep(100 * time.Millisecond) // containerd's log lines land a moment later
			create, shim, line, err := freshMarks(h.LogPath, off, id)
			if err != nil {
				return nil, err
			}
			per[rt] = append(per[rt], []time.Duration{create.Sub(t0), shim.Sub(create), t1.Sub(shim), t2.Sub(t1)})
			fb.totals[rt] = append(fb.totals[rt], t2.Sub(t0))
			if m := prepareRE.FindStringSubmatch(line); m != nil {
				d, _ := time.ParseDuration(m[1])
				fb.prepare = append(fb.prepare, d)
			}
			if m := runcCreateRE.FindStringSubmatch(line); m != nil {
				d, _ := time.ParseDuration(m[1])
				fb.runcCreat = append(fb.runcCreat, d)
			}
		}
	}
	for _, rt := range fb.runtimes {
		for p := range freshPhases {
			var ds []time.Duration
			for _, run := range per[rt] {
				ds = append(ds, run[p])
			}
			fb.median[rt] = append(fb.median[rt], report.Median(ds))
		}
	}
	return fb, nil
}

// freshMarks finds id's "creating task" and shim connection times, and the
// shim's "lazyfork: created" line ("" for runc.v2).
func freshMarks(logPath string, off int64, id string) (create, shim time.Time, created string, err error) {
	b, err := os.ReadFile(logPath)
	if err != nil {
		return create, shim, "", err
	}
	if off > int64(len(b)) {
		off = 0
	}
	for _, line := range strings.Split(string(b[off:]), "\n") {
		tm, msg := logTimeRE.FindStringSubmatch(line), logMsgRE.FindStringSubmatch(line)
		if tm == nil || msg == nil {
			continue
		}
		t, perr := time.Parse(time.RFC3339Nano, tm[1])
		if perr != nil {
			continue
		}
		idm := logIDRE.FindStringSubmatch(line)
		switch {
		case msg[1] == "creating task" && idm != nil && strings.Trim(idm[1], `"`) == id && create.IsZero():
			create = t
		case msg[1] == "connecting to shim "+id && shim.IsZero():
			shim = t
		case msg[1] == "lazyfork: created" && idm != nil && strings.Trim(idm[1], `"`) == id:
			created = line
		}
	}
	if create.IsZero() || shim.IsZero() {
		return create, shim, "", fmt.Errorf("containerd's log has no task create or shim connection for %s", id)
	}
	return create, shim, created, nil
}

func (fb *freshBreakdown) print(w io.Writer) {
	ms := func(d time.Duration) string { return fmt.Sprintf("%8.1f", float64(d.Microseconds())/1000) }
	fmt.Fprintf(w, "a fresh busybox task's start, phase by phase (ms, medians; same debug-logging containerd):\n")
	fmt.Fprintf(w, "  %-60s %8s %8s\n", "phase", "runc.v2", "lazyfork")
	for p, name := range freshPhases {
		fmt.Fprintf(w, "  %-60s %s %s\n", name, ms(fb.median[fb.runtimes[0]][p]), ms(fb.median[fb.runtimes[1]][p]))
	}
	fmt.Fprintf(w, "  %-60s %s %s\n", "total (create -> running)", ms(report.Median(fb.totals[fb.runtimes[0]])), ms(report.Median(fb.totals[fb.runtimes[1]])))
	fmt.Fprintf(w, "  lazyfork's Create: prepare %s ms, runc create (with its hooks) %s ms (medians)\n",
		strings.TrimSpace(ms(report.Median(fb.prepare))), strings.TrimSpace(ms(report.Median(fb.runcCreat))))
}
