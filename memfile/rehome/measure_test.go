package rehome

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"testing"
	"time"

	"github.com/lazyfork/lazyfork/internal/testutil"
)

// TestMeasure reports (no assertions) the pause of a move of 64 MiB and
// 1 GiB heaps, next to `criu dump --leave-running` of the same process,
// both onto a tmpfs. Run with LAZYFORK_REHOME_MEASURE=1.
func TestMeasure(t *testing.T) {
	if os.Getenv("LAZYFORK_REHOME_MEASURE") != "1" {
		t.Skip("set LAZYFORK_REHOME_MEASURE=1 to measure")
	}
	for _, mib := range []int{64, 1024} {
		t.Run(fmt.Sprintf("%dMiB", mib), func(t *testing.T) {
			dir := tmpfs(t)
			p := startProg(t, mib)
			p.verify()
			p.idle()
			t0 := time.Now()
			tr, err := Seize("", p.pid)
			if err != nil {
				t.Fatal(err)
			}
			t1 := time.Now()
			vmas, err := Plan(p.pid)
			if err != nil {
				t.Fatal(err)
			}
			t2 := time.Now()
			path := filepath.Join(dir, "mem")
			f, err := os.Create(path)
			if err != nil {
				t.Fatal(err)
			}
			n, err := CopyPages(p.pid, vmas, f)
			f.Close()
			if err != nil {
				t.Fatal(err)
			}
			t3 := time.Now()
			if _, err := tr.Remap(p.pid, path, vmas); err != nil {
				t.Fatal(err)
			}
			t4 := time.Now()
			if err := tr.Detach(); err != nil {
				t.Fatal(err)
			}
			t5 := time.Now()
			p.verify()
			if criu, err := exec.LookPath("criu"); err == nil {
				// The next snapshot of the moved process: its heap is a
				// file mapping, CRIU dumps only pages written since.
				img := filepath.Join(dir, "img-after")
				os.Mkdir(img, 0o755)
				p.cmdLine("mark")
				p.idle()
				s := time.Now()
				out, err := exec.Command(criu, "dump", "-t", fmt.Sprint(p.pid), "-D", img, "--leave-running", "--shell-job", "-o", "dump.log").CombinedOutput()
				if err != nil {
					log, _ := os.ReadFile(filepath.Join(img, "dump.log"))
					t.Logf("criu dump of the moved process failed: %v: %s\n%s", err, out, tail(log, 2000))
				} else {
					t.Logf("criu dump of the moved process after it wrote a page: %v, image %d kB", time.Since(s).Round(time.Microsecond), duKB(img))
				}
				os.RemoveAll(img)
			}
			t.Logf("rehome %d MiB: pause %v (seize %v, plan %v, copy %v for %d MB, remap %v for %d VMAs, detach %v)",
				mib, t5.Sub(t0).Round(time.Microsecond), t1.Sub(t0).Round(time.Microsecond), t2.Sub(t1).Round(time.Microsecond),
				t3.Sub(t2).Round(time.Microsecond), n>>20, t4.Sub(t3).Round(time.Microsecond), len(vmas), t5.Sub(t4).Round(time.Microsecond))

			if !testutil.InCI() {
				if criu, err := exec.LookPath("criu"); err == nil {
					q := startProg(t, mib)
					q.verify()
					q.idle()
					img := filepath.Join(dir, "img")
					os.Mkdir(img, 0o755)
					s := time.Now()
					out, err := exec.Command(criu, "dump", "-t", fmt.Sprint(q.pid), "-D", img, "--leave-running", "--shell-job", "-o", "dump.log").CombinedOutput()
					d := time.Since(s)
					if err != nil {
						log, _ := os.ReadFile(filepath.Join(img, "dump.log"))
						t.Logf("criu dump failed: %v: %s\n%s", err, out, tail(log, 2000))
						return
					}
					_, _, _, errs := q.verifyErrs()
					t.Logf("criu dump --leave-running %d MiB: %v wall, tmpfs %d MB (the rehome file is %d MB); %d blocking calls of the program failed with EINTR after it",
						mib, d.Round(time.Microsecond), tmpfsUsed(t, dir)>>20-uint64(n>>20), n>>20, errs)
				}
			}
		})
	}
}

func duKB(dir string) int64 {
	var n int64
	filepath.Walk(dir, func(_ string, fi os.FileInfo, err error) error {
		if err == nil && !fi.IsDir() {
			n += fi.Size()
		}
		return nil
	})
	return n >> 10
}

func tail(b []byte, n int) []byte {
	if len(b) > n {
		return b[len(b)-n:]
	}
	return b
}
