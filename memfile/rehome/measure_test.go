package rehome

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/lazyfork/lazyfork/internal/testutil"
)

// TestMeasure reports (no assertions) the pause of a move of 64 MiB and
// 1 GiB heaps, by Move (chunks of 64 MiB), by CopyPages (the process's own
// and the tracer's) then Remap, next to
// `criu dump --leave-running` of the same program, all onto a tmpfs, as
// medians of a few rounds; and the size of the CRIU dump of a moved process
// after it wrote a page. Run with LAZYFORK_REHOME_MEASURE=1.
func TestMeasure(t *testing.T) {
	if os.Getenv("LAZYFORK_REHOME_MEASURE") != "1" {
		t.Skip("set LAZYFORK_REHOME_MEASURE=1 to measure")
	}
	criu := testutil.RequiresCRIU(t) // and CRIU_FAULT where breakpoints do not trap
	const rounds = 5
	for _, mib := range []int{64, 1024} {
		t.Run(fmt.Sprintf("%dMiB", mib), func(t *testing.T) {
			res := map[string][]time.Duration{}
			for i := range rounds {
				for _, mode := range []string{"move", "process", "tracer", "criu"} {
					if mode == "criu" && criu == "" {
						continue
					}
					pause, copyT := measureOnce(t, mib, mode, criu, i == 0)
					res[mode+" pause"] = append(res[mode+" pause"], pause)
					if mode != "criu" && mode != "move" {
						res[mode+" copy"] = append(res[mode+" copy"], copyT)
					}
				}
			}
			for _, k := range []string{"move pause", "process pause", "process copy", "tracer pause", "tracer copy", "criu pause"} {
				if d := res[k]; len(d) > 0 {
					slices.Sort(d)
					t.Logf("%d MiB %-14s median %v (min %v, max %v, %d rounds)", mib, k, d[len(d)/2].Round(time.Millisecond),
						d[0].Round(time.Millisecond), d[len(d)-1].Round(time.Millisecond), len(d))
				}
			}
		})
	}
}

// measureOnce moves (or, for mode "criu", dumps) a fresh program and returns
// the pause and the copy time.
func measureOnce(t *testing.T, mib int, mode, criu string, detail bool) (pause, copyT time.Duration) {
	dir := tmpfs(t)
	p := startProg(t, mib)
	defer func() {
		// Free this round's memory before the next.
		p.cmd.Process.Kill()
		p.cmd.Wait()
		unix.Unmount(dir, unix.MNT_DETACH)
	}()
	p.verify()
	p.idle()
	if mode == "criu" {
		img := filepath.Join(dir, "img")
		os.Mkdir(img, 0o755)
		s := time.Now()
		out, err := exec.Command(criu, "dump", "-t", fmt.Sprint(p.pid), "-D", img, "--leave-running", "--shell-job", "-o", "dump.log").CombinedOutput()
		pause = time.Since(s)
		if err != nil {
			log, _ := os.ReadFile(filepath.Join(img, "dump.log"))
			t.Fatalf("criu dump: %v: %s\n%s", err, out, tail(log, 2000))
		}
		if _, _, _, errs := p.verifyErrs(); detail {
			t.Logf("after criu dump, %d blocking calls of the program failed with EINTR", errs)
		}
		return pause, 0
	}
	path := filepath.Join(dir, "mem")
	f, err := os.Create(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	t0 := time.Now()
	tr, err := Seize("", p.pid)
	if err != nil {
		t.Fatal(err)
	}
	vmas, err := Plan(p.pid)
	if err != nil {
		t.Fatal(err)
	}
	t1 := time.Now()
	if mode == "move" {
		if _, _, err := tr.Move(p.pid, path, vmas, 0); err != nil {
			t.Fatal(err)
		}
		if err := tr.Detach(); err != nil {
			t.Fatal(err)
		}
		pause = time.Since(t0)
		p.verify()
		return pause, 0
	}
	if mode == "tracer" {
		_, err = CopyPages(p.pid, vmas, f)
	} else {
		_, err = tr.CopyPages(p.pid, path, vmas)
	}
	if err != nil {
		t.Fatal(err)
	}
	t2 := time.Now()
	if _, err := tr.Remap(p.pid, path, vmas); err != nil {
		t.Fatal(err)
	}
	if err := tr.Detach(); err != nil {
		t.Fatal(err)
	}
	pause, copyT = time.Since(t0), t2.Sub(t1)
	p.verify()
	if detail && mode == "process" && criu != "" {
		// The next snapshot of the moved process: its heap is a file
		// mapping, CRIU dumps only the pages written since.
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
			t.Logf("criu dump of the moved process after it wrote a page: %v, image %d kB", time.Since(s).Round(time.Millisecond), duKB(img))
		}
	}
	return pause, copyT
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
