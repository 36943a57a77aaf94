// Command snapshotter measures fork rootfs preparation with frozen layers
// against a per-fork copy of the parent's upper layer (what a restore with
// containerd's `checkpoint --rw` amounts to), for parent upper layers of
// 1 MB, 100 MB and 1 GB. It prints a table, writes
// bench/results/snapshotter.csv and bench/results/snapshotter.png.
//
// Run as root: `make bench-snapshotter`
// (flags: -sizes, -forks, -dir, -out).
package main

import (
	"context"
	"flag"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"github.com/containerd/containerd/v2/pkg/namespaces"
	"github.com/containerd/continuity/fs"
	"golang.org/x/sys/unix"

	"github.com/lazyfork/lazyfork/bench/internal/report"
	"github.com/lazyfork/lazyfork/snapshotter"
	"github.com/lazyfork/lazyfork/snapshotter/client"
)

type result struct {
	FS          string // filesystem of the snapshotter root
	Runs        int    // medians of this many runs
	SizeBytes   int64
	Method      string // "frozen-layer" or "copy-per-fork"
	Mechanism   string // how data moved: reflink, copy_file_range, none
	Forks       int
	FreezeSec   float64 // one-off: both passes
	BulkSec     float64 // first pass, while the parent runs
	PrepareSec  float64 // mean per fork, after the freeze
	PerForkSec  float64 // (freeze + all prepares) / forks
	DiskBytes   int64   // blocks of the forks' layers (frozen layer included), as du counts them
	FSUsedDelta int64   // growth of the filesystem's used space: shared reflinked extents count once
	ParentPause float64 // time the parent must stay frozen

	runs []result // the runs this row is the median of (for the plot's error bars)
}

func main() {
	sizesFlag := flag.String("sizes", "1MB,100MB,1GB", "parent upper layer sizes")
	forks := flag.Int("forks", 10, "forks per size")
	dir := flag.String("dir", "/var/tmp", "directory on the filesystem to measure (the snapshotter root's)")
	out := flag.String("out", "results", "directory for snapshotter.csv and snapshotter.png")
	runs := flag.Int("runs", 3, "runs per size; the table shows medians (shared machines are noisy)")
	xfs := flag.Bool("xfs", true, "also measure on a loop-mounted XFS with reflinks (needs mkfs.xfs)")
	flag.Parse()

	sizes, err := parseSizes(*sizesFlag)
	if err != nil {
		fatal(err)
	}
	ctx := namespaces.WithNamespace(context.Background(), "bench")
	var results []result
	runAll := func(dir string) error {
		for _, size := range sizes {
			var all [][]result
			for range max(*runs, 1) {
				r, err := runSize(ctx, dir, size, *forks)
				if err != nil {
					return fmt.Errorf("%s on %s: %w", human(size), dir, err)
				}
				all = append(all, r)
			}
			results = append(results, medians(all)...)
		}
		return nil
	}
	if err := runAll(*dir); err != nil {
		fatal(err)
	}
	if *xfs {
		if _, err := exec.LookPath("mkfs.xfs"); err != nil {
			fmt.Fprintln(os.Stderr, "bench/snapshotter: no mkfs.xfs (apt-get install xfsprogs): skipping the reflink runs")
		} else {
			var largest int64
			for _, sz := range sizes {
				largest = max(largest, sz)
			}
			// Parent + frozen layer + one real copy per fork, plus slack.
			if err := withXFS(*dir, largest*int64(*forks+3)+(1<<30), runAll); err != nil {
				fatal(err)
			}
		}
	}
	printTable(os.Stdout, results)
	if err := writeCSV(filepath.Join(*out, "snapshotter.csv"), results); err != nil {
		fatal(err)
	}
	if err := writePlot(filepath.Join(*out, "snapshotter.png"), results); err != nil {
		fatal(err)
	}
	fmt.Printf("\nwrote %s and %s\n", filepath.Join(*out, "snapshotter.csv"), filepath.Join(*out, "snapshotter.png"))
}

func fatal(err error) {
	fmt.Fprintln(os.Stderr, "bench/snapshotter:", err)
	os.Exit(1)
}

func parseSizes(s string) ([]int64, error) {
	var out []int64
	for _, f := range strings.Split(s, ",") {
		f = strings.TrimSpace(strings.ToUpper(f))
		mult := int64(1)
		for suf, m := range map[string]int64{"KB": 1 << 10, "MB": 1 << 20, "GB": 1 << 30} {
			if strings.HasSuffix(f, suf) {
				mult, f = m, strings.TrimSuffix(f, suf)
				break
			}
		}
		n, err := strconv.ParseInt(f, 10, 64)
		if err != nil || n <= 0 {
			return nil, fmt.Errorf("bad size %q", f)
		}
		out = append(out, n*mult)
	}
	return out, nil
}

func human(n int64) string {
	switch {
	case n >= 1<<30:
		return fmt.Sprintf("%d GB", n>>30)
	case n >= 1<<20:
		return fmt.Sprintf("%d MB", n>>20)
	default:
		return fmt.Sprintf("%d KB", n>>10)
	}
}

// fillUpper writes size bytes into an upper dir: one big file holding most
// of it and 100 small files, the shape of a container that wrote a data file
// and some configuration.
func fillUpper(dir string, size int64) error {
	small := int64(100 * 1024)
	if small > size/2 {
		small = 0
	}
	for i := 0; small > 0 && i < 100; i++ {
		p := filepath.Join(dir, "etc", fmt.Sprintf("conf-%d", i))
		if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
			return err
		}
		if err := os.WriteFile(p, []byte(strings.Repeat("x", 1024)), 0o644); err != nil {
			return err
		}
	}
	f, err := os.Create(filepath.Join(dir, "data.bin"))
	if err != nil {
		return err
	}
	block := make([]byte, 1<<20)
	for i := range block {
		block[i] = byte(i * 31)
	}
	remaining := size - small
	for remaining > 0 {
		n := min(remaining, int64(len(block)))
		block[0]++ // no two blocks alike
		if _, err := f.Write(block[:n]); err != nil {
			f.Close()
			return err
		}
		remaining -= n
	}
	// On disk before timing: the parent's dirty pages are not what we measure.
	if err := f.Sync(); err != nil {
		f.Close()
		return err
	}
	return f.Close()
}

func du(ctx context.Context, dirs ...string) (int64, error) {
	var total int64
	for _, d := range dirs {
		u, err := fs.DiskUsage(ctx, d)
		if err != nil {
			return 0, err
		}
		total += u.Size
	}
	return total, nil
}

func runSize(ctx context.Context, dir string, size int64, forks int) ([]result, error) {
	root, err := os.MkdirTemp(dir, "lazyfork-bench-snapshotter-")
	if err != nil {
		return nil, err
	}
	defer os.RemoveAll(root)
	s, err := snapshotter.New(ctx, root)
	if err != nil {
		return nil, err
	}
	defer s.Close()

	// Image layer, then the parent's active snapshot and what it wrote.
	if _, err := s.Prepare(ctx, "image-extract", ""); err != nil {
		return nil, err
	}
	if err := s.Commit(ctx, "image", "image-extract"); err != nil {
		return nil, err
	}
	if _, err := s.Prepare(ctx, "parent", "image"); err != nil {
		return nil, err
	}
	parentUpper, err := upperOf(ctx, s, "parent")
	if err != nil {
		return nil, err
	}
	if err := fillUpper(parentUpper, size); err != nil {
		return nil, err
	}

	// Frozen layer: one copy under the freeze, then O(1) per fork.
	sync()
	used0 := usedBytes(root)
	t0 := time.Now()
	pending, err := client.StartFreeze(ctx, s, "parent", "frozen")
	if err != nil {
		return nil, err
	}
	bulk := time.Since(t0)
	// The parent keeps running between the passes and touches a file.
	if err := os.WriteFile(filepath.Join(parentUpper, "etc", "touched"), []byte("after the bulk copy"), 0o644); err != nil {
		return nil, err
	}
	tp := time.Now()
	if _, err := pending.Commit(ctx); err != nil {
		return nil, err
	}
	pause := time.Since(tp)
	freeze := time.Since(t0)
	mech := "copy_file_range"
	if st, err := s.Status(ctx); err == nil && st.Reflink {
		mech = "reflink"
	}
	var dirs []string
	t1 := time.Now()
	for i := range forks {
		if _, err := s.Prepare(ctx, fmt.Sprintf("fork-%d", i), "frozen"); err != nil {
			return nil, err
		}
	}
	prep := time.Since(t1)
	sync()
	lazyDelta := usedBytes(root) - used0
	frozenUpper, err := committedDir(ctx, s, "frozen")
	if err != nil {
		return nil, err
	}
	dirs = append(dirs, frozenUpper)
	for i := range forks {
		u, err := upperOf(ctx, s, fmt.Sprintf("fork-%d", i))
		if err != nil {
			return nil, err
		}
		dirs = append(dirs, u)
	}
	frozenDisk, err := du(ctx, dirs...)
	if err != nil {
		return nil, err
	}
	fsName := fsType(root)
	lazy := result{
		FS: fsName, SizeBytes: size, Method: "frozen-layer", Mechanism: mech, Forks: forks,
		FreezeSec:   freeze.Seconds(),
		BulkSec:     bulk.Seconds(),
		PrepareSec:  prep.Seconds() / float64(forks),
		PerForkSec:  (freeze + prep).Seconds() / float64(forks),
		DiskBytes:   frozenDisk,
		FSUsedDelta: lazyDelta,
		ParentPause: pause.Seconds(),
	}
	for i := range forks {
		if err := s.Remove(ctx, fmt.Sprintf("fork-%d", i)); err != nil {
			return nil, err
		}
	}
	if err := s.Remove(ctx, "frozen"); err != nil {
		return nil, err
	}

	// Baseline: each fork gets its own copy of the parent's upper layer
	// (the parent frozen for all of them, or its layer would move under
	// the later copies).
	sync()
	used1 := usedBytes(root)
	dirs = dirs[:0]
	t2 := time.Now()
	var copyMech string
	for i := range forks {
		key := fmt.Sprintf("copy-%d", i)
		if _, err := s.Prepare(ctx, key, "image"); err != nil {
			return nil, err
		}
		u, err := upperOf(ctx, s, key)
		if err != nil {
			return nil, err
		}
		// A real copy even where reflinks exist: what a restore that
		// unpacks the checkpoint's rootfs diff into each fork writes.
		st, err := snapshotter.CopyLayer(ctx, u, parentUpper, snapshotter.WithPlainCopy())
		if err != nil {
			return nil, err
		}
		copyMech = "read/write"
		if st.Reflinked > 0 {
			copyMech = "reflink"
		}
		dirs = append(dirs, u)
	}
	copies := time.Since(t2)
	sync()
	copyDelta := usedBytes(root) - used1
	copyDisk, err := du(ctx, dirs...)
	if err != nil {
		return nil, err
	}
	base := result{
		FS: fsName, SizeBytes: size, Method: "copy-per-fork", Mechanism: copyMech, Forks: forks,
		PrepareSec:  copies.Seconds() / float64(forks),
		PerForkSec:  copies.Seconds() / float64(forks),
		DiskBytes:   copyDisk,
		FSUsedDelta: copyDelta,
		ParentPause: copies.Seconds(),
	}
	return []result{lazy, base}, nil
}

// usedBytes is the used space of dir's filesystem (noisy on a shared one).
func usedBytes(dir string) int64 {
	var st unix.Statfs_t
	if err := unix.Statfs(dir, &st); err != nil {
		return 0
	}
	return int64(st.Blocks-st.Bfree) * st.Bsize
}

// sync flushes earlier writes so that one measurement's writeback does not
// land in the next.
func sync() {
	unix.Sync()
	if f, err := os.Open("/"); err == nil {
		_ = unix.Syncfs(int(f.Fd()))
		f.Close()
	}
}

func upperOf(ctx context.Context, s *snapshotter.Snapshotter, key string) (string, error) {
	ms, err := s.Mounts(ctx, key)
	if err != nil {
		return "", err
	}
	for _, o := range ms[0].Options {
		if v, ok := strings.CutPrefix(o, "upperdir="); ok {
			return v, nil
		}
	}
	if ms[0].Type == "bind" {
		return ms[0].Source, nil
	}
	return "", fmt.Errorf("no upper dir in %+v", ms)
}

// committedDir finds a committed snapshot's layer through a view on it.
func committedDir(ctx context.Context, s *snapshotter.Snapshotter, name string) (string, error) {
	ms, err := s.View(ctx, name+"-view", name)
	if err != nil {
		return "", err
	}
	defer s.Remove(ctx, name+"-view")
	if ms[0].Type == "bind" {
		return ms[0].Source, nil
	}
	for _, o := range ms[0].Options {
		if v, ok := strings.CutPrefix(o, "lowerdir="); ok {
			return strings.Split(v, ":")[0], nil
		}
	}
	return "", fmt.Errorf("no layer in %+v", ms)
}

func printTable(w io.Writer, rs []result) {
	t := &report.Table{Columns: []string{"fs", "upper", "method", "data moved by", "forks", "freeze (s)", "of it running (s)",
		"prepare/fork (s)", "total/fork (s)", "parent frozen (s)", "du of forks", "fs used +"}}
	for _, r := range rs {
		t.Add(r.FS, human(r.SizeBytes), r.Method, r.Mechanism, r.Forks, fmt.Sprintf("%.4f", r.FreezeSec), fmt.Sprintf("%.4f", r.BulkSec),
			fmt.Sprintf("%.6f", r.PrepareSec), fmt.Sprintf("%.4f", r.PerForkSec), fmt.Sprintf("%.4f", r.ParentPause),
			humanBytes(r.DiskBytes), humanBytes(r.FSUsedDelta))
	}
	t.Print(w)
}

func humanBytes(n int64) string {
	if n < 0 {
		return "-" + humanBytes(-n)
	}
	switch {
	case n >= 1<<30:
		return fmt.Sprintf("%.2f GB", float64(n)/(1<<30))
	case n >= 1<<20:
		return fmt.Sprintf("%.1f MB", float64(n)/(1<<20))
	default:
		return fmt.Sprintf("%d KB", n>>10)
	}
}

func writeCSV(path string, rs []result) error {
	t := &report.Table{Columns: []string{"fs", "upper_bytes", "method", "mechanism", "forks", "freeze_s", "freeze_running_s",
		"prepare_per_fork_s", "total_per_fork_s", "parent_frozen_s", "du_bytes", "fs_used_delta_bytes", "runs"}}
	for _, r := range rs {
		t.Rows = append(t.Rows, []string{
			r.FS, strconv.FormatInt(r.SizeBytes, 10), r.Method, r.Mechanism, strconv.Itoa(r.Forks),
			fmt.Sprintf("%.6f", r.FreezeSec), fmt.Sprintf("%.6f", r.BulkSec), fmt.Sprintf("%.6f", r.PrepareSec), fmt.Sprintf("%.6f", r.PerForkSec),
			fmt.Sprintf("%.6f", r.ParentPause), strconv.FormatInt(r.DiskBytes, 10), strconv.FormatInt(r.FSUsedDelta, 10), strconv.Itoa(r.Runs),
		})
	}
	return t.WriteCSV(path)
}

func fsType(dir string) string {
	var st unix.Statfs_t
	if err := unix.Statfs(dir, &st); err != nil {
		return "unknown"
	}
	switch st.Type {
	case unix.EXT4_SUPER_MAGIC:
		return "ext4"
	case unix.XFS_SUPER_MAGIC:
		return "xfs"
	case unix.BTRFS_SUPER_MAGIC:
		return "btrfs"
	case unix.TMPFS_MAGIC:
		return "tmpfs"
	}
	return fmt.Sprintf("0x%x", st.Type)
}

// withXFS runs fn on a fresh XFS (reflink=1) loop-mounted from a sparse
// image file under dir, and removes it all afterwards.
func withXFS(dir string, size int64, fn func(string) error) (err error) {
	work, err := os.MkdirTemp(dir, "lazyfork-bench-xfs-")
	if err != nil {
		return err
	}
	defer os.RemoveAll(work)
	img := filepath.Join(work, "xfs.img")
	f, err := os.Create(img)
	if err != nil {
		return err
	}
	if err := f.Truncate(size); err != nil {
		f.Close()
		return err
	}
	f.Close()
	if out, err := exec.Command("mkfs.xfs", "-q", "-m", "reflink=1", img).CombinedOutput(); err != nil {
		return fmt.Errorf("mkfs.xfs: %v: %s", err, out)
	}
	mnt := filepath.Join(work, "mnt")
	if err := os.Mkdir(mnt, 0o700); err != nil {
		return err
	}
	if out, err := exec.Command("mount", "-o", "loop", img, mnt).CombinedOutput(); err != nil {
		return fmt.Errorf("mount %s: %v: %s", img, err, out)
	}
	defer func() {
		if out, uerr := exec.Command("umount", "-d", mnt).CombinedOutput(); uerr != nil && err == nil {
			err = fmt.Errorf("umount %s: %v: %s", mnt, uerr, out)
		}
	}()
	return fn(mnt)
}

// medians combines runs field by field (each run yields the same rows).
func medians(runs [][]result) []result {
	out := make([]result, len(runs[0]))
	for i := range out {
		out[i] = runs[0][i]
		f := func(get func(result) float64) float64 {
			vs := make([]float64, len(runs))
			for j, r := range runs {
				vs[j] = get(r[i])
			}
			return report.Median(vs)
		}
		out[i].FreezeSec = f(func(r result) float64 { return r.FreezeSec })
		out[i].BulkSec = f(func(r result) float64 { return r.BulkSec })
		out[i].PrepareSec = f(func(r result) float64 { return r.PrepareSec })
		out[i].PerForkSec = f(func(r result) float64 { return r.PerForkSec })
		out[i].ParentPause = f(func(r result) float64 { return r.ParentPause })
		out[i].DiskBytes = int64(f(func(r result) float64 { return float64(r.DiskBytes) }))
		out[i].FSUsedDelta = int64(f(func(r result) float64 { return float64(r.FSUsedDelta) }))
		out[i].Runs = len(runs)
		for _, r := range runs {
			out[i].runs = append(out[i].runs, r[i])
		}
	}
	return out
}
