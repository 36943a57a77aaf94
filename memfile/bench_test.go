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
