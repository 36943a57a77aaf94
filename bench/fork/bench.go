package main

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/containerd/cgroups/v3"
	tasksapi "github.com/containerd/containerd/api/services/tasks/v1"
	runcopts "github.com/containerd/containerd/api/types/runc/options"
	containerd "github.com/containerd/containerd/v2/client"
	"github.com/containerd/containerd/v2/pkg/cio"
	"github.com/containerd/typeurl/v2"
	"golang.org/x/sys/unix"

	lfclient "github.com/lazyfork/lazyfork/client"
	"github.com/lazyfork/lazyfork/integration/harness"
	"github.com/lazyfork/lazyfork/memfile"
)

const counterPy = "/opt/lazyfork/workloads/counter.py"

type bench struct {
	h        *harness.Containerd
	root     string // LAZYFORK_ROOT (a private tmpfs)
	img      containerd.Image
	lf       *lfclient.Client
	nForks   int
	plainMax int
	m        *results
	seq      int
}

func newBench(bin string, nForks, plainMax int) (_ *bench, retErr error) {
	root, err := os.MkdirTemp("/tmp", "lfb-")
	if err != nil {
		return nil, err
	}
	b := &bench{root: root, nForks: nForks, plainMax: plainMax, m: &results{}}
	defer func() {
		if retErr != nil {
			b.close()
		}
	}()
	ctx := context.Background()
	b.h, err = harness.Start(ctx, harness.Options{BinDirs: []string{bin}, Env: []string{"LAZYFORK_ROOT=" + root}})
	if err != nil {
		return nil, err
	}
	b.img, err = b.h.ImportImage(ctx, "python")
	if err != nil {
		return nil, err
	}
	b.lf = lfclient.New(b.h.Client(), lfclient.WithRoot(root))
	return b, nil
}

func (b *bench) close() {
	if b.h != nil {
		if err := b.h.Stop(); err != nil {
			fmt.Fprintln(os.Stderr, "bench-fork: teardown:", err)
		}
	}
	_ = unix.Unmount(b.root, unix.MNT_DETACH)
	os.RemoveAll(b.root)
}

func (b *bench) id(prefix string) string {
	b.seq++
	return fmt.Sprintf("%s-%d", prefix, b.seq)
}

// counter is a running counter.py container.
type counter struct {
	id   string
	ctr  containerd.Container
	task containerd.Task
}

func (b *bench) startCounter(ctx context.Context, id, runtime string, heapMiB int) (*counter, error) {
	ctx = b.h.Context(ctx)
	ctr, err := b.h.NewContainer(ctx, id, harness.ContainerConfig{
		Image:   b.img,
		Args:    []string{"python3", counterPy, strconv.Itoa(heapMiB)},
		Runtime: runtime,
	})
	if err != nil {
		return nil, err
	}
	task, err := b.h.StartTask(ctx, ctr)
	if err != nil {
		return nil, err
	}
	c := &counter{id: id, ctr: ctr, task: task}
	for _, p := range []string{"ready ", "tick 2"} {
		if err := b.waitLine(ctx, id, 0, p); err != nil {
			return c, err
		}
	}
	return c, nil
}

func (b *bench) waitLine(ctx context.Context, id string, skip int, prefix string) error {
	ctx, cancel := context.WithTimeout(ctx, 3*time.Minute)
	defer cancel()
	_, err := harness.WaitLine(ctx, b.h.TaskLogPath(id), skip, func(l string) bool { return strings.HasPrefix(l, prefix) })
	return err
}

// remove deletes tasks and containers (with snapshots), ignoring what is gone.
func (b *bench) remove(ctx context.Context, ctrs ...containerd.Container) {
	ctx = b.h.Context(ctx)
	for _, c := range ctrs {
		if c == nil {
			continue
		}
		if t, err := c.Task(ctx, nil); err == nil {
			_, _ = t.Delete(ctx, containerd.WithProcessKill)
		}
		_ = c.Delete(ctx, containerd.WithSnapshotCleanup)
	}
}

// memory is a container's cgroup memory usage in bytes.
func (b *bench) memory(ctx context.Context, ctr containerd.Container) (int64, error) {
	spec, err := ctr.Spec(b.h.Context(ctx))
	if err != nil {
		return 0, err
	}
	p := spec.Linux.CgroupsPath
	file := filepath.Join("/sys/fs/cgroup/memory", p, "memory.usage_in_bytes")
	if cgroups.Mode() == cgroups.Unified {
		file = filepath.Join("/sys/fs/cgroup", p, "memory.current")
	}
	data, err := os.ReadFile(file)
	if err != nil {
		return 0, err
	}
	return strconv.ParseInt(strings.TrimSpace(string(data)), 10, 64)
}

// shimRSS sums the resident memory of the shim processes serving containerd.
func (b *bench) shimRSS() (rss, pss int64, n int) {
	for _, pid := range harness.ShimPIDs(b.h.Address) {
		data, err := os.ReadFile(fmt.Sprintf("/proc/%d/smaps_rollup", pid))
		if err != nil {
			continue
		}
		n++
		for _, l := range strings.Split(string(data), "\n") {
			f := strings.Fields(l)
			if len(f) < 2 {
				continue
			}
			v, _ := strconv.ParseInt(f[1], 10, 64)
			switch f[0] {
			case "Rss:":
				rss += v << 10
			case "Pss:":
				pss += v << 10
			}
		}
	}
	return rss, pss, n
}

func (b *bench) logIO() lfclient.ForkOpt {
	return lfclient.WithIO(func(id string) cio.Creator { return cio.LogFile(b.h.TaskLogPath(id)) })
}

// lazyfork measures LazyFork forks of a counter holding heapMiB.
func (b *bench) lazyfork(ctx context.Context, heapMiB int) error {
	ctx = b.h.Context(ctx)
	m := b.m
	sys := "lazyfork"
	parent, err := b.startCounter(ctx, b.id(fmt.Sprintf("lf%d", heapMiB)), "io.containerd.lazyfork.v1", heapMiB)
	var made []containerd.Container
	defer func() { b.remove(context.WithoutCancel(ctx), made...) }()
	if parent != nil {
		made = append(made, parent.ctr)
	}
	if err != nil {
		return err
	}
	if pm, err := b.memory(ctx, parent.ctr); err == nil {
		m.add(heapMiB, sys, "parent_memory", float64(pm), "B")
	}

	// The snapshot and one fork.
	res, err := b.lf.Fork(ctx, parent.id, 1, lfclient.KeepSnapshot(), b.logIO())
	if err != nil {
		return err
	}
	defer b.lf.RemoveSnapshot(context.WithoutCancel(ctx), res.Snapshot)
	made = append(made, res.Forks[0].Container)
	m.addDur(heapMiB, sys, "snapshot_pause", res.Paused)
	m.addDur(heapMiB, sys, "snapshot_dump_rewrite", res.Checkpoint)
	m.addDur(heapMiB, sys, "snapshot_copy_upper", res.CopyUpper)
	m.addDur(heapMiB, sys, "restore_1", res.Forks[0].Restore)
	if mem, err := b.memory(ctx, res.Forks[0].Container); err == nil {
		m.add(heapMiB, sys, "memory_after_restore_1", float64(mem), "B")
	}
	if total, pages, err := imageSize(res.Snapshot); err == nil {
		m.add(heapMiB, sys, "snapshot_image", float64(total), "B")
		m.add(heapMiB, sys, "snapshot_image_pages", float64(pages), "B")
	}

	// n forks at once from the same snapshot.
	t0 := time.Now()
	forks, err := b.lf.RestoreForks(ctx, parent.id, res.Snapshot, b.nForks, b.logIO())
	wall := time.Since(t0)
	for _, f := range forks {
		made = append(made, f.Container)
	}
	if err != nil {
		return err
	}
	var each []time.Duration
	var mems []float64
	for _, f := range forks {
		each = append(each, f.Restore)
		if mem, err := b.memory(ctx, f.Container); err == nil {
			mems = append(mems, float64(mem))
		}
	}
	m.addDur(heapMiB, sys, fmt.Sprintf("restore_%d_median", b.nForks), median(each))
	m.addDur(heapMiB, sys, fmt.Sprintf("restore_%d_max", b.nForks), maxDur(each))
	m.addDur(heapMiB, sys, fmt.Sprintf("restore_%d_wall_incl_rootfs", b.nForks), wall)
	m.add(heapMiB, sys, "memory_after_restore_median", medianF(mems), "B")
	m.add(heapMiB, sys, "memory_after_restore_max", maxF(mems), "B")

	// 5 s of running, each fork writing a page a second (the tick loop reads).
	for s := 0; s < 5; s++ {
		for _, f := range forks {
			_ = f.Task.Kill(ctx, syscall.SIGUSR2)
		}
		time.Sleep(time.Second)
	}
	mems = mems[:0]
	for _, f := range forks {
		if mem, err := b.memory(ctx, f.Container); err == nil {
			mems = append(mems, float64(mem))
		}
	}
	m.add(heapMiB, sys, "memory_after_5s_median", medianF(mems), "B")
	m.add(heapMiB, sys, "memory_after_5s_max", maxF(mems), "B")
	rss, pss, nShims := b.shimRSS()
	served := b.nForks + 2 // the parent, its first fork, the n forks
	m.add(heapMiB, sys, "shim_processes", float64(nShims), "")
	m.add(heapMiB, sys, "shim_rss_per_fork", float64(rss)/float64(served), "B")
	m.add(heapMiB, sys, "shim_pss_per_fork", float64(pss)/float64(served), "B")

	// A fork of a fork: the snapshot of a fork that wrote 5 pages.
	famDir := filepath.Join(b.root, "mem", res.Family)
	before := memFiles(famDir)
	child := forks[0]
	res2, err := b.lf.Fork(ctx, child.Container.ID(), 1, lfclient.KeepSnapshot(), b.logIO())
	if err != nil {
		return fmt.Errorf("fork of a fork: %w", err)
	}
	defer b.lf.RemoveSnapshot(context.WithoutCancel(ctx), res2.Snapshot)
	made = append(made, res2.Forks[0].Container)
	var delta int64
	for name, size := range memFiles(famDir) {
		if _, ok := before[name]; !ok {
			delta += size
		}
	}
	m.addDur(heapMiB, sys, "fork_of_fork_pause", res2.Paused)
	m.addDur(heapMiB, sys, "fork_of_fork_dump_rewrite", res2.Checkpoint)
	m.add(heapMiB, sys, "fork_of_fork_new_memory_files", float64(delta), "B")
	if total, _, err := imageSize(res2.Snapshot); err == nil {
		m.add(heapMiB, sys, "fork_of_fork_snapshot_image", float64(total), "B")
	}
	m.addDur(heapMiB, sys, "fork_of_fork_restore", res2.Forks[0].Restore)
	if mem, err := b.memory(ctx, res2.Forks[0].Container); err == nil {
		m.add(heapMiB, sys, "fork_of_fork_memory_after_restore", float64(mem), "B")
	}
	return nil
}

// plain measures runc's own checkpoint/restore of the same workload.
func (b *bench) plain(ctx context.Context, heapMiB int) error {
	ctx = b.h.Context(ctx)
	m := b.m
	sys := "plain"
	parent, err := b.startCounter(ctx, b.id(fmt.Sprintf("pl%d", heapMiB)), harness.RuncRuntime, heapMiB)
	var made []containerd.Container
	defer func() { b.remove(context.WithoutCancel(ctx), made...) }()
	if parent != nil {
		made = append(made, parent.ctr)
	}
	if err != nil {
		return err
	}
	dir, err := b.h.TempDir("plain-ckpt-")
	if err != nil {
		return err
	}
	defer os.RemoveAll(dir)
	opts, err := typeurl.MarshalAnyToProto(&runcopts.CheckpointOptions{ImagePath: dir})
	if err != nil {
		return err
	}
	t0 := time.Now()
	if err := parent.task.Pause(ctx); err != nil {
		return err
	}
	_, cerr := b.h.Client().TaskService().Checkpoint(ctx, &tasksapi.CheckpointTaskRequest{ContainerID: parent.id, Options: opts})
	rerr := parent.task.Resume(ctx)
	paused := time.Since(t0)
	if err := errors.Join(cerr, rerr); err != nil {
		return err
	}
	m.addDur(heapMiB, sys, "snapshot_pause", paused)
	if total, pages, err := imageSize(dir); err == nil {
		m.add(heapMiB, sys, "snapshot_image", float64(total), "B")
		m.add(heapMiB, sys, "snapshot_image_pages", float64(pages), "B")
	}

	restore := func(n int) ([]containerd.Container, []time.Duration, error) {
		ctrs := make([]containerd.Container, n)
		for i := range ctrs {
			c, err := b.h.CloneContainer(ctx, parent.ctr, b.id(fmt.Sprintf("pl%dr", heapMiB)))
			if err != nil {
				return ctrs[:i], nil, err
			}
			ctrs[i] = c
		}
		each := make([]time.Duration, n)
		errs := make([]error, n)
		var wg sync.WaitGroup
		for i := range n {
			wg.Add(1)
			go func() {
				defer wg.Done()
				t := time.Now()
				_, errs[i] = b.h.StartTask(ctx, ctrs[i], containerd.WithRestoreImagePath(dir))
				each[i] = time.Since(t)
			}()
		}
		wg.Wait()
		return ctrs, each, errors.Join(errs...)
	}
	one, each, err := restore(1)
	made = append(made, one...)
	if err != nil {
		return err
	}
	m.addDur(heapMiB, sys, "restore_1", each[0])
	if mem, err := b.memory(ctx, one[0]); err == nil {
		m.add(heapMiB, sys, "memory_after_restore_1", float64(mem), "B")
	}
	b.remove(ctx, one...)
	if heapMiB > b.plainMax {
		return nil
	}
	many, each, err := restore(b.nForks)
	made = append(made, many...)
	if err != nil {
		return err
	}
	var mems []float64
	for _, c := range many {
		if mem, err := b.memory(ctx, c); err == nil {
			mems = append(mems, float64(mem))
		}
	}
	m.addDur(heapMiB, sys, fmt.Sprintf("restore_%d_median", b.nForks), median(each))
	m.addDur(heapMiB, sys, fmt.Sprintf("restore_%d_max", b.nForks), maxDur(each))
	m.add(heapMiB, sys, "memory_after_restore_median", medianF(mems), "B")
	return nil
}

// imageSize sums the files of an image directory and its pages-*.img files.
func imageSize(dir string) (total, pages int64, err error) {
	err = filepath.WalkDir(dir, func(p string, d fs.DirEntry, err error) error {
		if err != nil || d.IsDir() {
			return err
		}
		info, err := d.Info()
		if err != nil {
			return err
		}
		total += info.Size()
		if ok, _ := filepath.Match("pages-*.img", d.Name()); ok {
			pages += info.Size()
		}
		return nil
	})
	return total, pages, err
}

// memFiles maps a family's memory files to the bytes they occupy on the tmpfs.
func memFiles(dir string) map[string]int64 {
	out := map[string]int64{}
	ents, _ := os.ReadDir(dir)
	for _, e := range ents {
		if !strings.HasSuffix(e.Name(), memfile.FileExt) {
			continue
		}
		var st unix.Stat_t
		if unix.Stat(filepath.Join(dir, e.Name()), &st) == nil {
			out[e.Name()] = st.Blocks * 512
		}
	}
	return out
}

func median(ds []time.Duration) time.Duration {
	if len(ds) == 0 {
		return 0
	}
	s := append([]time.Duration(nil), ds...)
	sort.Slice(s, func(i, j int) bool { return s[i] < s[j] })
	return s[len(s)/2]
}

func maxDur(ds []time.Duration) time.Duration {
	var m time.Duration
	for _, d := range ds {
		m = max(m, d)
	}
	return m
}

func medianF(v []float64) float64 {
	if len(v) == 0 {
		return 0
	}
	s := append([]float64(nil), v...)
	sort.Float64s(s)
	return s[len(s)/2]
}

func maxF(v []float64) float64 {
	var m float64
	for _, x := range v {
		m = max(m, x)
	}
	return m
}
