package rehome

import (
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/lazyfork/lazyfork/internal/testutil"
)

// memcgV1 creates a cgroup v1 memory cgroup for a test.
func memcgV1(t *testing.T) string {
	t.Helper()
	root := "/sys/fs/cgroup/memory"
	if _, err := os.Stat(filepath.Join(root, "memory.usage_in_bytes")); err != nil {
		if testutil.InCI() {
			t.Fatalf("no cgroup v1 memory controller at %s", root)
		}
		t.Skipf("no cgroup v1 memory controller at %s", root)
	}
	cg := filepath.Join(root, fmt.Sprintf("lazyfork-rehome-test-%d-%d", os.Getpid(), time.Now().UnixNano()))
	if err := os.Mkdir(cg, 0o755); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		for i := 0; i < 100; i++ {
			if err := os.Remove(cg); err == nil {
				return
			}
			time.Sleep(20 * time.Millisecond)
		}
		t.Errorf("cgroup %s stays", cg)
	})
	return cg
}

func memStat(t *testing.T, cg, key string) uint64 {
	t.Helper()
	b, err := os.ReadFile(filepath.Join(cg, "memory.stat"))
	if err != nil {
		t.Fatal(err)
	}
	for l := range strings.SplitSeq(string(b), "\n") {
		if v, ok := strings.CutPrefix(l, key+" "); ok {
			n, _ := strconv.ParseUint(v, 10, 64)
			return n
		}
	}
	t.Fatalf("%s: no %s in memory.stat", cg, key)
	return 0
}

// The memory file's pages are charged to the process whose memory they
// hold when it copies them itself: its cgroup's anonymous memory becomes
// shmem, the total stays; the tracer's copy charges the caller instead.
func TestCopyChargedToProcessCgroup(t *testing.T) {
	for _, byTracer := range []bool{false, true} {
		t.Run(fmt.Sprintf("byTracer=%v", byTracer), func(t *testing.T) {
			dir := tmpfs(t)
			cg := memcgV1(t)
			p := startProgIn(t, 64, cg)
			t.Cleanup(func() { p.cmd.Process.Kill(); p.cmd.Wait() })
			p.verify()
			rss0, shmem0 := memStat(t, cg, "rss"), memStat(t, cg, "shmem")
			rehome(t, p, "", filepath.Join(dir, "mem"), byTracer)
			p.verify()
			rss1, shmem1 := memStat(t, cg, "rss"), memStat(t, cg, "shmem")
			t.Logf("cgroup of the process: rss %d -> %d MB, shmem %d -> %d MB", rss0>>20, rss1>>20, shmem0>>20, shmem1>>20)
			if rss0-rss1 < 60<<20 {
				t.Errorf("the cgroup's anonymous memory fell by %d MB, want about 64", (rss0-rss1)>>20)
			}
			charged := shmem1 - shmem0
			if !byTracer && charged < 60<<20 {
				t.Errorf("the memory file's pages are not charged to the process's cgroup: its shmem grew by %d MB", charged>>20)
			}
			if byTracer && charged > 8<<20 {
				t.Logf("tracer copy: %d MB charged to the process's cgroup", charged>>20)
			}
		})
	}
}

func readUint(t *testing.T, path string) uint64 {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	n, err := strconv.ParseUint(strings.TrimSpace(string(b)), 10, 64)
	if err != nil {
		t.Fatalf("%s: %v", path, err)
	}
	return n
}

// A process whose memory limit leaves room for less than its heap twice
// moves by Move in chunks, without reaching its limit, and each VMA ends up
// one mapping of its slot.
func TestMoveInChunksUnderMemoryLimit(t *testing.T) {
	dir := tmpfs(t)
	cg := memcgV1(t)
	p := startProgIn(t, 64, cg)
	t.Cleanup(func() { p.cmd.Process.Kill(); p.cmd.Wait() })
	ticks, t1, t2 := p.verify()
	usage := readUint(t, filepath.Join(cg, "memory.usage_in_bytes"))
	limit := usage + 24<<20
	if err := os.WriteFile(filepath.Join(cg, "memory.limit_in_bytes"), []byte(fmt.Sprint(limit)), 0); err != nil {
		t.Fatal(err)
	}
	path := filepath.Join(dir, "mem")
	if err := os.WriteFile(path, nil, 0o644); err != nil {
		t.Fatal(err)
	}
	tr, vmas := seizePlanned(t, p)
	done, st, err := tr.Move(p.pid, path, vmas, 8<<20)
	if derr := tr.Detach(); derr != nil {
		t.Error(derr)
	}
	if err != nil || len(done) != len(vmas) {
		t.Fatalf("Move: %d of %d VMAs: %v", len(done), len(vmas), err)
	}
	t.Logf("usage %d MB, limit %d MB, max usage during the move %d MB; %+v", usage>>20, limit>>20,
		readUint(t, filepath.Join(cg, "memory.max_usage_in_bytes"))>>20, st)
	if st.ByTracer > st.Bytes/10 {
		t.Errorf("the tracer copied %d of %d bytes: the process's own writes failed", st.ByTracer, st.Bytes)
	}
	waitTicks(t, p, ticks, t1, t2)
	hv := vmaAt(t, vmas, p.heap[0])
	hdr, _ := smapsEntry(t, p.pid, p.heap[0])
	if want := fmt.Sprintf("%x-%x ", hv.Start, hv.End); !strings.HasPrefix(hdr, want) || !strings.HasSuffix(hdr, path) {
		t.Errorf("heap is not one mapping of %s over %s: %s", path, want, hdr)
	}
	if shmem := memStat(t, cg, "shmem"); shmem < 60<<20 {
		t.Errorf("the file's pages are not charged to the process's cgroup: shmem %d MB", shmem>>20)
	}
}
