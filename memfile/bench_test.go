package memfile_test

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"testing"
	"time"

	"github.com/lazyfork/lazyfork/criuimg"
	"github.com/lazyfork/lazyfork/internal/criurun"
	"github.com/lazyfork/lazyfork/internal/procfs"
	"github.com/lazyfork/lazyfork/memfile"
)

// BenchmarkRewrite rewrites a real dump of a process with a 256 MiB heap
// (image on the test's temp dir, files on a tmpfs) and reports its
// throughput beside a plain copy of the same pages file to the same tmpfs:
//
//	LAZYFORK_INTEGRATION=1 go test -run '^$' -bench Rewrite -benchtime 5x ./memfile
func BenchmarkRewrite(b *testing.B) {
	for _, mib := range []int{64, 256} {
		b.Run(fmt.Sprintf("heap=%dMiB", mib), func(b *testing.B) {
			e := newEnv(b)
			dir := e.dump(e.start(mib, 0))
			pm, err := criuimg.ReadPagemap(dir, 1)
			if err != nil {
				b.Fatal(err)
			}
			pages := criuimg.PagesPath(dir, pm.PagesID)
			st, _ := os.Stat(pages)
			var rewrite, plain time.Duration
			var bytes int64
			for i := 0; i < b.N; i++ {
				b.StopTimer()
				work := filepath.Join(e.tmp, fmt.Sprintf("bench-%d", i))
				copyDir(b, dir, work)
				exec.Command("cat", pages).Run() // warm, like a fresh dump
				t0 := time.Now()
				if out, err := exec.Command("cp", pages, filepath.Join(e.famDir, "plain.copy")).CombinedOutput(); err != nil {
					b.Fatalf("cp: %v %s", err, out)
				}
				plain += time.Since(t0)
				os.Remove(filepath.Join(e.famDir, "plain.copy"))
				b.StartTimer()
				res, err := e.store.Rewrite(context.Background(), work, memfile.RewriteOptions{Family: e.family, MapDir: e.famDir})
				if err != nil {
					b.Fatal(err)
				}
				b.StopTimer()
				rewrite += res.Duration
				bytes = res.BytesWritten
				os.RemoveAll(work)
				e.store.GC(context.Background())
				b.StartTimer()
			}
			gib := func(d time.Duration, n int64) float64 { return float64(n) / (1 << 30) / d.Seconds() * float64(b.N) }
			b.ReportMetric(gib(rewrite, bytes), "rewrite-GiB/s")
			b.ReportMetric(gib(plain, st.Size()), "cp-GiB/s")
			b.ReportMetric(gib(rewrite, bytes)/gib(plain, st.Size()), "ratio")
		})
	}
}

// BenchmarkRestore restores copies of a rewritten dump and of the same dump
// left plain, and reports each restore's time and the copy's RssAnon:
//
//	LAZYFORK_INTEGRATION=1 go test -run '^$' -bench Restore -benchtime 5x ./memfile
func BenchmarkRestore(b *testing.B) {
	for _, mib := range []int{256, 1024} {
		b.Run(fmt.Sprintf("heap=%dMiB", mib), func(b *testing.B) {
			e := newEnv(b)
			pid := e.start(mib, 1)
			dir := e.dump(pid)
			plain := dir + "-plain"
			copyDir(b, dir, plain)
			e.rewrite(dir)
			kill(pid) // a plain copy needs the PIDs free; so do not keep the parent
			var lazy, orig time.Duration
			var anonLazy, anonPlain int64
			for i := 0; i < b.N; i++ {
				r, err := criurun.Restore(context.Background(), dir, criurun.RestoreOptions{})
				if err != nil {
					b.Fatal(err)
				}
				lazy += r.Duration
				m, _ := procfs.TreeMem(r.PID)
				anonLazy += m.RssAnon
				kill(r.PID)
				r, err = criurun.Restore(context.Background(), plain, criurun.RestoreOptions{})
				if err != nil {
					b.Fatal(err)
				}
				orig += r.Duration
				m, _ = procfs.TreeMem(r.PID)
				anonPlain += m.RssAnon
				kill(r.PID)
			}
			n := float64(b.N)
			b.ReportMetric(float64(lazy.Milliseconds())/n, "memfile-restore-ms")
			b.ReportMetric(float64(orig.Milliseconds())/n, "plain-restore-ms")
			b.ReportMetric(float64(anonLazy)/n/1024, "memfile-RssAnon-kB")
			b.ReportMetric(float64(anonPlain)/n/1024, "plain-RssAnon-kB")
		})
	}
}
