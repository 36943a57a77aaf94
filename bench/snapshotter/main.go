// Command snapshotter measures fork rootfs preparation with frozen layers
// against a per-fork copy of the parent's upper layer (what a restore with
// containerd's `checkpoint --rw` amounts to), for parent upper layers of
// 1 MB, 100 MB and 1 GB. It prints a table, writes
// bench/results/snapshotter.csv and bench/results/snapshotter.png.
//
// Run as root from the repository root: `make bench-snapshotter`
// (flags: -sizes, -forks, -dir, -out).
package main

import (
	"context"
	"encoding/csv"
	"flag"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/containerd/containerd/v2/pkg/namespaces"
	"github.com/containerd/continuity/fs"
	"golang.org/x/sys/unix"

	"github.com/lazyfork/lazyfork/snapshotter"
)

type result struct {
	SizeBytes   int64
	Method      string // "frozen-layer" or "copy-per-fork"
	Mechanism   string // how data moved: reflink, copy_file_range, none
	Forks       int
	FreezeSec   float64 // one-off, under the parent's freeze
	PrepareSec  float64 // mean per fork, after the freeze
	PerForkSec  float64 // (freeze + all prepares) / forks
	DiskBytes   int64   // disk taken by the forks' layers (frozen layer included)
	ParentPause float64 // time the parent must stay frozen
}

func main() {
	sizesFlag := flag.String("sizes", "1MB,100MB,1GB", "parent upper layer sizes")
	forks := flag.Int("forks", 10, "forks per size")
	dir := flag.String("dir", "/var/tmp", "directory on the filesystem to measure (the snapshotter root's)")
	out := flag.String("out", "bench/results", "directory for snapshotter.csv and snapshotter.png")
	flag.Parse()

	sizes, err := parseSizes(*sizesFlag)
	if err != nil {
		fatal(err)
	}
	ctx := namespaces.WithNamespace(context.Background(), "bench")
	var results []result
	for _, size := range sizes {
		r, err := runSize(ctx, *dir, size, *forks)
		if err != nil {
			fatal(fmt.Errorf("%s: %w", human(size), err))
		}
		results = append(results, r...)
	}
	printTable(os.Stdout, results)
	if err := os.MkdirAll(*out, 0o755); err != nil {
		fatal(err)
	}
	if err := writeCSV(filepath.Join(*out, "snapshotter.csv"), results); err != nil {
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
	t0 := time.Now()
	if _, err := s.Freeze(ctx, "parent", "frozen"); err != nil {
		return nil, err
	}
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
	lazy := result{
		SizeBytes: size, Method: "frozen-layer", Mechanism: mech, Forks: forks,
		FreezeSec:   freeze.Seconds(),
		PrepareSec:  prep.Seconds() / float64(forks),
		PerForkSec:  (freeze + prep).Seconds() / float64(forks),
		DiskBytes:   frozenDisk,
		ParentPause: freeze.Seconds(),
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
		st, err := snapshotter.CopyLayer(ctx, u, parentUpper)
		if err != nil {
			return nil, err
		}
		copyMech = "copy_file_range"
		if st.Reflinked > 0 {
			copyMech = "reflink"
		}
		dirs = append(dirs, u)
	}
	copies := time.Since(t2)
	copyDisk, err := du(ctx, dirs...)
	if err != nil {
		return nil, err
	}
	base := result{
		SizeBytes: size, Method: "copy-per-fork", Mechanism: copyMech, Forks: forks,
		PrepareSec:  copies.Seconds() / float64(forks),
		PerForkSec:  copies.Seconds() / float64(forks),
		DiskBytes:   copyDisk,
		ParentPause: copies.Seconds(),
	}
	return []result{lazy, base}, nil
}

// sync flushes earlier writes so that one measurement's writeback does not
// land in the next.
func sync() {
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
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(tw, "upper\tmethod\tdata moved by\tforks\tfreeze (s)\tprepare/fork (s)\ttotal/fork (s)\tparent frozen (s)\tdisk for forks\t")
	for _, r := range rs {
		fmt.Fprintf(tw, "%s\t%s\t%s\t%d\t%.4f\t%.6f\t%.4f\t%.4f\t%s\t\n", human(r.SizeBytes), r.Method, r.Mechanism, r.Forks,
			r.FreezeSec, r.PrepareSec, r.PerForkSec, r.ParentPause, humanBytes(r.DiskBytes))
	}
	tw.Flush()
}

func humanBytes(n int64) string {
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
	tmp := path + ".tmp"
	f, err := os.Create(tmp)
	if err != nil {
		return err
	}
	w := csv.NewWriter(f)
	w.Write([]string{"upper_bytes", "method", "mechanism", "forks", "freeze_s", "prepare_per_fork_s", "total_per_fork_s", "parent_frozen_s", "disk_bytes"})
	for _, r := range rs {
		w.Write([]string{
			strconv.FormatInt(r.SizeBytes, 10), r.Method, r.Mechanism, strconv.Itoa(r.Forks),
			fmt.Sprintf("%.6f", r.FreezeSec), fmt.Sprintf("%.6f", r.PrepareSec), fmt.Sprintf("%.6f", r.PerForkSec),
			fmt.Sprintf("%.6f", r.ParentPause), strconv.FormatInt(r.DiskBytes, 10),
		})
	}
	w.Flush()
	if err := w.Error(); err != nil {
		f.Close()
		return err
	}
	if err := f.Close(); err != nil {
		return err
	}
	return os.Rename(tmp, path)
}
