package rehome

import (
	"bufio"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/lazyfork/lazyfork/internal/testutil"
	"golang.org/x/sys/unix"
)

var (
	buildOnce sync.Once
	buildDir  string
	buildErr  error
)

// heapProg builds testdata/heapprog.c once per test binary.
func heapProg(t testing.TB) string {
	t.Helper()
	testutil.RequiresRoot(t)
	gcc := testutil.RequiresBinary(t, "gcc")
	buildOnce.Do(func() {
		buildDir, buildErr = os.MkdirTemp("", "rehome-prog-")
		if buildErr != nil {
			return
		}
		out, err := exec.Command(gcc, "-O2", "-pthread", "-o", filepath.Join(buildDir, "heapprog"), "testdata/heapprog.c").CombinedOutput()
		if err != nil {
			buildErr = fmt.Errorf("gcc: %v: %s", err, out)
		}
	})
	if buildErr != nil {
		t.Fatal(buildErr)
	}
	return filepath.Join(buildDir, "heapprog")
}

// prog is a running heapprog.
type prog struct {
	t     testing.TB
	cmd   *exec.Cmd
	in    io.WriteCloser
	lines chan string
	pid   int
	heap  [2]uint64 // addr, len
	brk   [2]uint64
	spare [2]uint64
	// signalled: the test sent it signals, whose handler fails its poll
	// (EINTR): verify does not count that against it.
	signalled bool
}

func startProg(t testing.TB, mib int) *prog { return startProgIn(t, mib, "") }

// startProgIn starts heapprog inside the cgroup v1 directory cg (if not
// ""), so that all its memory is charged there.
func startProgIn(t testing.TB, mib int, cg string) *prog {
	t.Helper()
	bin := heapProg(t)
	cmd := exec.Command(bin, strconv.Itoa(mib))
	if cg != "" {
		cmd = exec.Command("/bin/sh", "-c", `echo $$ > "$1/cgroup.procs" && exec "$2" "$3"`, "sh", cg, bin, strconv.Itoa(mib))
	}
	in, err := cmd.StdinPipe()
	if err != nil {
		t.Fatal(err)
	}
	out, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	cmd.Stderr = os.Stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	p := &prog{t: t, cmd: cmd, in: in, lines: make(chan string, 16), pid: cmd.Process.Pid}
	go func() {
		sc := bufio.NewScanner(out)
		for sc.Scan() {
			p.lines <- sc.Text()
		}
		close(p.lines)
	}()
	t.Cleanup(func() {
		cmd.Process.Kill()
		cmd.Wait() // only now: a concurrent wait4 would take ptrace stops
	})
	for {
		l := p.line()
		f := strings.Fields(l)
		if l == "ready" {
			break
		}
		if len(f) != 3 {
			t.Fatalf("heapprog: unexpected line %q", l)
		}
		a, _ := strconv.ParseUint(strings.TrimPrefix(f[1], "0x"), 16, 64)
		n, _ := strconv.ParseUint(f[2], 10, 64)
		switch f[0] {
		case "heap":
			p.heap = [2]uint64{a, n}
		case "brk":
			p.brk = [2]uint64{a, n}
		case "spare":
			p.spare = [2]uint64{a, n}
		}
	}
	return p
}

func (p *prog) line() string {
	p.t.Helper()
	select {
	case l, ok := <-p.lines:
		if !ok {
			p.t.Fatalf("heapprog %d: output closed (exited?)", p.pid)
		}
		return l
	case <-time.After(60 * time.Second):
		p.t.Fatalf("heapprog %d: no answer in 60s", p.pid)
	}
	return ""
}

func (p *prog) cmdLine(c string) string {
	p.t.Helper()
	if _, err := fmt.Fprintln(p.in, c); err != nil {
		p.t.Fatalf("heapprog %d: %s: %v", p.pid, c, err)
	}
	return p.line()
}

// verify asks the program to check its memory and returns its tick counters.
func (p *prog) verify() (ticks, t1, t2 uint64) {
	p.t.Helper()
	ticks, t1, t2, errs := p.verifyErrs()
	if errs != 0 && !p.signalled {
		p.t.Fatalf("heapprog %d: %d blocking calls failed instead of restarting", p.pid, errs)
	}
	return
}

// verifyErrs is verify that returns the count of failed blocking calls.
func (p *prog) verifyErrs() (ticks, t1, t2, errs uint64) {
	p.t.Helper()
	l := p.cmdLine("verify")
	if _, err := fmt.Sscanf(l, "ok ticks=%d t1=%d t2=%d errs=%d", &ticks, &t1, &t2, &errs); err != nil {
		p.t.Fatalf("heapprog %d: verify: %q", p.pid, l)
	}
	return
}

// idle waits until the main thread (the one system calls are injected
// into) sits in its poll, so the move interrupts a blocking call that must
// restart.
func (p *prog) idle() {
	p.t.Helper()
	for i := 0; ; i++ {
		b, err := os.ReadFile(fmt.Sprintf("/proc/%d/syscall", p.pid))
		if err != nil {
			p.t.Fatal(err)
		}
		if nr, _, _ := strings.Cut(string(b), " "); nr == "7" || nr == "271" {
			return
		}
		if i == 1000 {
			p.t.Fatalf("heapprog %d: main thread not in poll: %s", p.pid, b)
		}
		time.Sleep(time.Millisecond)
	}
}

// pat is heapprog's pattern word.
func pat(page, word uint64) uint64 { return (page << 20) ^ (word * 0x9e3779b97f4a7c15) ^ 0x5a5a }

// statusKB reads a "Name: N kB" line of /proc/pid/status.
func statusKB(t testing.TB, pid int, name string) uint64 {
	t.Helper()
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		t.Fatal(err)
	}
	for l := range strings.SplitSeq(string(b), "\n") {
		if v, ok := strings.CutPrefix(l, name+":"); ok {
			return parseKB([]byte(v))
		}
	}
	t.Fatalf("process %d: no %s in status", pid, name)
	return 0
}

// smapsEntry returns the smaps block of the VMA containing addr.
func smapsEntry(t testing.TB, pid int, addr uint64) (header string, fields map[string]uint64) {
	t.Helper()
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/smaps", pid))
	if err != nil {
		t.Fatal(err)
	}
	in := false
	for l := range strings.SplitSeq(string(b), "\n") {
		if v, _, ok := parseHeader([]byte(l)); ok {
			if in {
				return
			}
			in = v.Start <= addr && addr < v.End
			if in {
				header, fields = l, map[string]uint64{}
			}
			continue
		}
		if in {
			if k, v, ok := strings.Cut(l, ":"); ok && strings.HasSuffix(strings.TrimSpace(v), "kB") {
				fields[k] = parseKB([]byte(v))
			}
		}
	}
	if header == "" {
		t.Fatalf("process %d: no VMA at %#x", pid, addr)
	}
	return
}

// tmpfs mounts a private tmpfs for the memory files.
func tmpfs(t testing.TB) string {
	t.Helper()
	dir := t.TempDir()
	if err := unix.Mount("tmpfs", dir, "tmpfs", 0, "size=8g,mode=0755"); err != nil {
		t.Fatalf("mount tmpfs on %s: %v", dir, err)
	}
	t.Cleanup(func() { unix.Unmount(dir, unix.MNT_DETACH) })
	return dir
}

func tmpfsUsed(t testing.TB, dir string) uint64 {
	var st unix.Statfs_t
	if err := unix.Statfs(dir, &st); err != nil {
		t.Fatal(err)
	}
	return (st.Blocks - st.Bfree) * uint64(st.Bsize)
}

// vmaAt returns the planned VMA containing addr.
func vmaAt(t testing.TB, vmas []VMA, addr uint64) VMA {
	t.Helper()
	for _, v := range vmas {
		if v.Start <= addr && addr < v.End {
			return v
		}
	}
	t.Fatalf("no planned VMA holds %#x: %v", addr, vmas)
	return VMA{}
}

// seizePlanned waits until p idles, seizes it and plans its move (the
// Tracee detached again if the plan fails).
func seizePlanned(t testing.TB, p *prog) (*Tracee, []VMA) {
	t.Helper()
	p.idle()
	tr, err := Seize("", p.pid)
	if err != nil {
		t.Fatal(err)
	}
	vmas, err := Plan(p.pid)
	if err != nil {
		tr.Detach()
		t.Fatal(err)
	}
	return tr, vmas
}

// rehome runs the whole move on p into path and returns the plan and the
// VMAs moved. The pages are copied by the process itself (Tracee.CopyPages)
// unless byTracer.
func rehome(t testing.TB, p *prog, cgroup, path string, byTracer ...bool) ([]VMA, []VMA) {
	t.Helper()
	if cgroup == "" {
		p.idle()
	}
	tr, err := Seize(cgroup, p.pid)
	if err != nil {
		t.Fatalf("Seize: %v", err)
	}
	vmas, err := Plan(p.pid)
	if err != nil {
		tr.Detach()
		t.Fatalf("Plan: %v", err)
	}
	f, err := os.Create(path)
	if err != nil {
		tr.Detach()
		t.Fatal(err)
	}
	defer f.Close()
	if len(byTracer) > 0 && byTracer[0] {
		_, err = CopyPages(p.pid, vmas, f)
	} else {
		var st CopyStats
		st, err = tr.CopyPages(p.pid, path, vmas)
		t.Logf("copied by the process: %+v", st)
		if err == nil && (st.ByTracer > st.Bytes/10 || st.Calls == 0) {
			t.Errorf("the process did not copy its pages itself: %+v", st)
		}
	}
	if err != nil {
		tr.Detach()
		t.Fatalf("CopyPages: %v", err)
	}
	done, err := tr.Remap(p.pid, path, vmas)
	if derr := tr.Detach(); derr != nil {
		t.Errorf("Detach: %v", derr)
	}
	if err != nil {
		t.Fatalf("Remap: %v", err)
	}
	return vmas, done
}

func TestMain(m *testing.M) {
	code := m.Run()
	if buildDir != "" {
		os.RemoveAll(buildDir)
	}
	os.Exit(code)
}
