// Command zdtm runs CRIU's own zdtm static tests (test/zdtm/static of the CRIU
// source that `make deps` fetches) as a conformance test of LazyFork's rewrite.
// Each test runs three ways, each from a fresh start:
//
//	plain      CRIU dump, restore (the control)
//	rewritten  CRIU dump, LazyFork rewrite (memfile, with the madvise guard the
//	           shim adds by default), restore
//	           (a test listed in madvise.list runs with the guard mode a user
//	           of such a program would choose, lazyfork.io/madvise; in zero
//	           mode a supervisor traces each restored copy, as the shim's does)
//	fork2      as rewritten, then the restored copy is dumped, rewritten and
//	           restored again (a fork of a fork)
//
// As zdtm.py judges it, a way passes when the test, sent SIGTERM after the last
// restore, writes PASS into its output file, and when the restored tree shows
// the visible state it had before its first dump: the same processes, the
// same file descriptor numbers and the same mappings
// (zdtm.py's view: start, end and protection, neighbours of equal
// protection merged; a mapping of a memory file stands for the anonymous
// memory it replaced).
//
// Tests run in zdtm.py's host flavour ('h') by default: the test daemon
// lives in the host's namespaces and its dump is restored in place once it
// is gone. So a test can change the host: tests.list leaves out those that
// do (cgroup hierarchies, firewall rules, security policies). -flavor ns
// runs zdtm.py's namespace flavour instead (see nsFlavor): new pid, mount,
// network, ipc and uts namespaces under a root of its own, with the family
// directory mounted in it (as the shim mounts it in a container).
// -flavor uns adds a user namespace (root mapped to host uid 20000, as
// zdtm's lib/ns.c maps it) and restores with --mntns-compat-mode (CRIU
// 4.1.1's mount-v2 fails here to mount the root from its user-namespace
// daemon: EINVAL). Plain passes; a rewritten copy cannot: CRIU opens its
// memory files from inside the user namespace, and they are 0400, owned by
// host root and immutable once sealed, so the mapped root gets EACCES
// ("Can't open file lazyfork-mem/....mem on restore: Permission denied").
// (Nothing in memfile or the shim makes memory files readable to a mapped
// root, so a fork of a user-namespaced container would likely meet the same
// wall; not tried here.)
// Output: a CSV (test,plain,rewritten,fork2,detail) and a summary on stdout;
// the exit status is 1 when a test that passes plain fails another way.
//
// Usage (root): go run ./zdtm [-list zdtm/ci.list] [-out FILE] [-run REGEXP] [-flavor h|ns|uns]
package main

import (
	"bufio"
	"context"
	"encoding/csv"
	"errors"
	"flag"
	"fmt"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"regexp"
	"runtime"
	"slices"
	"sort"
	"strconv"
	"strings"
	"sync/atomic"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/lazyfork/lazyfork/internal/criurun"
	"github.com/lazyfork/lazyfork/internal/criurun/memloop"
	"github.com/lazyfork/lazyfork/internal/hwbreak"
	"github.com/lazyfork/lazyfork/internal/procfs"
	"github.com/lazyfork/lazyfork/memfile"
	"github.com/lazyfork/lazyfork/memfile/madvguard"
)

var modes = []string{"plain", "rewritten", "fork2"}

// current is the root pid of the test running now (for a signal to kill).
var current atomic.Int64

type config struct {
	src, work, list, out string
	known, madviseList   string
	run                  *regexp.Regexp
	guard                bool
	madvise              string // "": per test (madvise.list, else refuse)
	flavor               string // "h" (host) or "ns"
	timeout              time.Duration
	keep                 bool
}

func main() {
	// The zero-mode supervisor is this program re-executed.
	madvguard.MaybeServe()
	var c config
	var run string
	flag.StringVar(&c.src, "src", "/var/cache/lazyfork/criu/criu-4.1.1", "CRIU source tree (make deps fetches it)")
	flag.StringVar(&c.work, "work", "/var/tmp/lazyfork-zdtm", "work directory: a copy of the CRIU tree where the tests are built, images, memory files")
	flag.StringVar(&c.list, "list", "zdtm/tests.list", "tests to run, one a line (# comments)")
	flag.StringVar(&c.known, "known", "zdtm/known.list", "known differences from plain CRIU: TEST REASON a line; reported, not counted as failures")
	flag.StringVar(&c.out, "out", "", "CSV of the results (default WORK/results.csv)")
	flag.StringVar(&run, "run", "", "only the tests of the list matching this regular expression")
	flag.BoolVar(&c.guard, "guard", true, "add the madvise guard to rewritten snapshots, as the shim does by default (false: -madvise off)")
	flag.StringVar(&c.madviseList, "madvise-list", "zdtm/madvise.list", "tests run with another guard mode: TEST MODE REASON a line")
	flag.StringVar(&c.madvise, "madvise", "", "guard mode of every test: refuse, zero or off (default: refuse, or the test's line in -madvise-list)")
	flag.StringVar(&c.flavor, "flavor", "h", "zdtm.py flavour: h (the host's namespaces), ns (new pid, mount, net, ipc, uts namespaces) or uns (ns and a user namespace)")
	flag.DurationVar(&c.timeout, "timeout", 2*time.Minute, "bound of one test run (one way)")
	flag.BoolVar(&c.keep, "keep", false, "keep each run's images and CRIU logs under WORK/runs")
	flag.Parse()
	if c.out == "" {
		c.out = filepath.Join(c.work, "results.csv")
	}
	if run != "" {
		c.run = regexp.MustCompile(run)
	}
	code, err := mainErr(c)
	if err != nil {
		fmt.Fprintln(os.Stderr, "zdtm:", err)
		os.Exit(2)
	}
	os.Exit(code)
}

func mainErr(c config) (int, error) {
	if os.Geteuid() != 0 {
		return 0, errors.New("needs root (CRIU)")
	}
	// zdtm's CRIU runs inherit it: where the host's breakpoints do not trap,
	// every dump would hang (hwbreak).
	if set, err := hwbreak.SetCRIUEnv(); err != nil {
		fmt.Fprintf(os.Stderr, "zdtm: hardware breakpoint probe: %v (CRIU_FAULT=130 set: %v)\n", err, set)
	} else if set {
		fmt.Fprintln(os.Stderr, "zdtm: hardware breakpoints do not trap on this host: CRIU runs with CRIU_FAULT=130")
	}
	tests, err := readList(c.list, c.run)
	if err != nil {
		return 0, err
	}
	if err := criurun.BecomeSubreaper(); err != nil {
		return 0, err
	}
	closeInherited()
	// Interrupted: the running test's tree goes too.
	sigs := make(chan os.Signal, 1)
	signal.Notify(sigs, unix.SIGINT, unix.SIGTERM)
	go func() {
		s := <-sigs
		if pid := int(current.Load()); pid > 0 {
			killTree(pid)
		}
		fmt.Fprintf(os.Stderr, "zdtm: %v: stopped\n", s)
		os.Exit(130)
	}()
	static, built, err := build(c, tests)
	if err != nil {
		return 0, err
	}
	loop, err := memloop.Open(filepath.Join(c.work, "mem"), "zdtm", 8<<30)
	if err != nil {
		return 0, err
	}
	defer loop.Close()
	// The runner adds the guard itself, in each test's mode.
	loop.Guard = false
	guards, err := readModes(c)
	if err != nil {
		return 0, err
	}
	r := &runner{c: c, static: static, loop: loop, guards: guards}
	switch c.flavor {
	case "h":
	case "ns", "uns":
		testDir := filepath.Dir(filepath.Dir(static))
		if r.ns, err = newNSFlavor(c.work, testDir, loop.MapDir, c.flavor == "uns"); err != nil {
			return 0, fmt.Errorf("ns flavour: %w", err)
		}
		defer r.ns.close()
	default:
		return 0, fmt.Errorf("-flavor %q: want h, ns or uns", c.flavor)
	}

	f, err := os.Create(c.out)
	if err != nil {
		return 0, err
	}
	defer f.Close()
	w := csv.NewWriter(f)
	w.Write(append(append([]string{"test"}, modes...), "detail"))
	var rows [][]string
	for i, t := range tests {
		row := []string{t}
		var details []string
		if !built[t] {
			for range modes {
				row = append(row, "build-failed")
			}
			details = append(details, "did not build")
		} else if d, err := readDesc(filepath.Join(static, t+".desc")); err == nil && !slices.Contains(d.flavors, c.flavor) {
			// As zdtm.py: a test names the flavours it runs in.
			for range modes {
				row = append(row, "not-run")
			}
			details = append(details, fmt.Sprintf("flavours %s only", strings.Join(d.flavors, " ")))
		} else {
			for _, m := range modes {
				res, detail := "error", ""
				if err != nil {
					detail = err.Error()
				} else {
					res, detail = r.runOne(t, m, d)
				}
				row = append(row, res)
				if detail != "" {
					details = append(details, m+": "+detail)
				}
			}
		}
		if g := r.madvise(t); g != "refuse" {
			details = append(details, "madvise="+g)
		}
		row = append(row, strings.Join(details, "; "))
		rows = append(rows, row)
		w.Write(row)
		w.Flush()
		fmt.Printf("[%d/%d] %-32s %s\n", i+1, len(tests), t, strings.Join(row[1:len(modes)+1], " "))
	}
	known, err := readKnown(c.known)
	if err != nil {
		return 0, err
	}
	return summary(rows, known, c.out), w.Error()
}

// closeInherited marks every descriptor this process inherited beyond
// stdio close-on-exec, as zdtm.py starts tests (close_fds): Go passes such
// descriptors on to every child, and a test holding one on a file outside
// its namespaces cannot be dumped.
func closeInherited() {
	ents, _ := os.ReadDir("/proc/self/fd")
	for _, e := range ents {
		if fd, err := strconv.Atoi(e.Name()); err == nil && fd > 2 {
			unix.CloseOnExec(fd)
		}
	}
}

// readList reads a test list: one name a line, # comments.
func readList(path string, run *regexp.Regexp) ([]string, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return nil, err
	}
	var out []string
	for _, l := range strings.Split(string(b), "\n") {
		l = strings.TrimSpace(l)
		if i := strings.IndexByte(l, '#'); i >= 0 {
			l = strings.TrimSpace(l[:i])
		}
		if l == "" || (run != nil && !run.MatchString(l)) {
			continue
		}
		out = append(out, l)
	}
	if len(out) == 0 {
		return nil, fmt.Errorf("%s: no test selected", path)
	}
	return out, nil
}

// build copies the CRIU tree into the work directory (once) and builds zdtm's
// library and the tests; it returns the static directory and what built.
func build(c config, tests []string) (string, map[string]bool, error) {
	tree := filepath.Join(c.work, "criu")
	if _, err := os.Stat(filepath.Join(tree, "test/zdtm/static/Makefile")); err != nil {
		if _, err := os.Stat(filepath.Join(c.src, "test/zdtm/static/Makefile")); err != nil {
			return "", nil, fmt.Errorf("no CRIU source with zdtm tests at %s (make deps fetches it): %w", c.src, err)
		}
		if err := os.MkdirAll(c.work, 0o755); err != nil {
			return "", nil, err
		}
		os.RemoveAll(tree + ".tmp")
		if out, err := exec.Command("cp", "-a", c.src, tree+".tmp").CombinedOutput(); err != nil {
			return "", nil, fmt.Errorf("copy %s: %v: %s", c.src, err, out)
		}
		if err := os.Rename(tree+".tmp", tree); err != nil {
			return "", nil, err
		}
	}
	jobs := strconv.Itoa(runtime.NumCPU())
	lib := exec.Command("make", "-s", "-C", filepath.Join(tree, "test/zdtm/lib"), "-j"+jobs)
	if out, err := lib.CombinedOutput(); err != nil {
		return "", nil, fmt.Errorf("build zdtm lib: %v: %s", err, tail(string(out), 20))
	}
	static := filepath.Join(tree, "test/zdtm/static")
	// -k: a test that does not build here (another arch, a missing header) is
	// reported, not fatal.
	mk := exec.Command("make", append([]string{"-s", "-k", "-C", static, "-j" + jobs}, tests...)...)
	out, _ := mk.CombinedOutput()
	built := map[string]bool{}
	for _, t := range tests {
		if st, err := os.Stat(filepath.Join(static, t)); err == nil && st.Mode()&0o111 != 0 {
			built[t] = true
		}
	}
	if len(built) == 0 {
		return "", nil, fmt.Errorf("no zdtm test built: %s", tail(string(out), 20))
	}
	return static, built, nil
}

// desc is what a test's .desc says that matters here.
type desc struct {
	opts  []string // extra CRIU options, dump and restore
	flags string
	// flavors are zdtm.py's flavours the test runs in ('flavor', default
	// all three).
	flavors []string
}

var descField = regexp.MustCompile(`'(\w+)'\s*:\s*'([^']*)'`)

func readDesc(path string) (desc, error) {
	d := desc{flavors: []string{"h", "ns", "uns"}}
	b, err := os.ReadFile(path)
	if errors.Is(err, os.ErrNotExist) {
		return d, nil
	}
	if err != nil {
		return d, err
	}
	for _, m := range descField.FindAllStringSubmatch(string(b), -1) {
		switch m[1] {
		case "opts":
			d.opts = strings.Fields(m[2])
		case "flags":
			d.flags = m[2]
		case "flavor":
			d.flavors = strings.Fields(m[2])
		}
	}
	return d, nil
}

type runner struct {
	c      config
	static string
	loop   *memloop.Loop
	guards map[string]string // test -> madvise mode other than refuse (madvise.list)
	ns     *nsFlavor         // nil: the host flavour
	seq    int
}

// madvise is the guard mode test t runs with: "refuse", "zero" or "off".
func (r *runner) madvise(t string) string {
	switch {
	case !r.c.guard:
		return "off"
	case r.c.madvise != "":
		return r.c.madvise
	case r.guards[t] != "":
		return r.guards[t]
	}
	return "refuse"
}

// readModes reads the tests that run in another guard mode: "TEST MODE
// REASON" a line (-madvise-list), and checks -madvise.
func readModes(c config) (map[string]string, error) {
	check := func(m string) error {
		if m == "off" {
			return nil
		}
		_, err := madvguard.ParseMode(m)
		return err
	}
	if c.madvise != "" {
		if err := check(c.madvise); err != nil {
			return nil, err
		}
	}
	modes := map[string]string{}
	b, err := os.ReadFile(c.madviseList)
	if errors.Is(err, os.ErrNotExist) {
		return modes, nil
	}
	if err != nil {
		return nil, err
	}
	for i, l := range strings.Split(string(b), "\n") {
		l = strings.TrimSpace(l)
		if l == "" || l[0] == '#' {
			continue
		}
		f := strings.Fields(l)
		if len(f) < 3 {
			return nil, fmt.Errorf("%s:%d: want TEST MODE REASON", c.madviseList, i+1)
		}
		if err := check(f[1]); err != nil {
			return nil, fmt.Errorf("%s:%d: %w", c.madviseList, i+1, err)
		}
		modes[f[0]] = f[1]
	}
	return modes, nil
}

// rewrite turns a dump into a snapshot of the loop's family, guarded as
// the shim guards a checkpoint (memloop's options, the guard in mode).
func (r *runner) rewrite(ctx context.Context, img, mode string) error {
	opts := memfile.RewriteOptions{Family: r.loop.Family, MapDir: r.loop.MapDir, FileRoot: "/"}
	if r.ns != nil {
		opts.MapDir, opts.FileRoot = memMount, r.ns.root
	}
	if mode != "off" {
		m, err := madvguard.ParseMode(mode)
		if err != nil {
			return err
		}
		opts.Stage = func(ctx context.Context, staging string) error {
			ranges, err := madvguard.DataRanges(staging, opts.MapDir, r.loop.MapDir)
			if err != nil {
				return err
			}
			return madvguard.ApplyMode(staging, ranges, m)
		}
	}
	_, err := r.loop.Store.Rewrite(ctx, img, opts)
	return err
}

// runOne runs test t one way from a fresh start; it returns PASS, FAIL, or
// the stage that broke (start, dump, rewrite, restore, state, exit), and a
// detail.
func (r *runner) runOne(t, mode string, d desc) (string, string) {
	ctx, cancel := context.WithTimeout(context.Background(), r.c.timeout)
	defer cancel()
	r.seq++
	runDir := filepath.Join(r.c.work, "runs", fmt.Sprintf("%s-%s", t, mode))
	os.RemoveAll(runDir)
	if !r.c.keep {
		defer os.RemoveAll(runDir)
	}
	// What an earlier run left: pid and output files (some tests keep more,
	// e.g. <t>.out.external, and refuse to start if it exists), test files.
	for _, pat := range []string{".pid*", ".out*", ".test*", ".*.test*"} {
		old, _ := filepath.Glob(filepath.Join(r.static, t+pat))
		for _, p := range old {
			os.RemoveAll(p)
		}
	}
	defer reapOrphans()
	sctx, scancel := context.WithTimeout(ctx, 30*time.Second)
	defer scancel()
	start := exec.CommandContext(sctx, "make", "-s", "-C", r.static, t+".pid")
	// A test whose daemon dies before it is ready leaves its first process
	// waiting for ever, holding make's output: the timeout kills the whole
	// process group, and the wait gives up on the pipe.
	start.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	dumpArgs, restoreArgs := d.opts, d.opts
	if r.ns != nil {
		if err := r.ns.prepare(filepath.Join(r.static, t)); err != nil {
			return "start", fmt.Sprintf("ns root: %v", err)
		}
		// As zdtm.py: make runs in the root, so that the test's working
		// directory is under it (ns.c keeps it across pivot_root).
		start.Args = []string{"make", "-s", "-C", "zdtm/static", t + ".pid"}
		start.Dir = r.ns.root
		start.Env = append(os.Environ(), r.ns.env()...)
		dumpArgs = append(slices.Clone(d.opts), r.ns.dumpArgs()...)
		restoreArgs = append(slices.Clone(d.opts), r.ns.restoreArgs()...)
	}
	start.Cancel = func() error { return syscall.Kill(-start.Process.Pid, syscall.SIGKILL) }
	start.WaitDelay = 5 * time.Second
	if out, err := start.CombinedOutput(); err != nil {
		return "start", fmt.Sprintf("%v: %s", err, oneLine(tail(string(out)+r.outFile(t), 3)))
	}
	pid, err := r.pid(t)
	if err != nil {
		return "start", err.Error()
	}
	current.Store(int64(pid))
	defer current.Store(0)
	defer killTree(pid)
	// The test daemon is ready; its children may still be settling (closing
	// what they inherited): the state is taken a moment later.
	time.Sleep(200 * time.Millisecond)
	before, err := visible(pid, "")
	if err != nil {
		return "start", err.Error()
	}
	cur := pid
	guard := "off"
	if mode != "plain" {
		guard = r.madvise(t)
	}
	// In zero mode a supervisor traces each restored copy (as the shim's
	// does) and lets go before its dump.
	var sup *madvguard.Remote
	defer func() {
		if sup != nil {
			sup.Close()
		}
	}()
	rounds := 1
	if mode == "fork2" {
		rounds = 2
	}
	for round := 1; round <= rounds; round++ {
		img := filepath.Join(runDir, fmt.Sprintf("img%d", round))
		if sup != nil {
			err := sup.Close()
			sup = nil
			if err != nil {
				return "dump", fmt.Sprintf("detach the madvise supervisor: %v", err)
			}
		}
		if _, err := criurun.Dump(ctx, cur, img, criurun.DumpOptions{Kill: true, ExtraArgs: dumpArgs}); err != nil {
			killTree(cur)
			return "dump", logError(err)
		}
		reapOrphans()
		if mode != "plain" {
			if err := r.rewrite(ctx, img, guard); err != nil {
				return "rewrite", oneLine(err.Error())
			}
		}
		if r.ns != nil && r.ns.userns {
			// As zdtm.py: CRIU reads the images from inside the user
			// namespace too.
			os.Chmod(img, 0o777)
		}
		res, err := criurun.Restore(ctx, img, criurun.RestoreOptions{WorkDir: filepath.Join(runDir, fmt.Sprintf("restore%d", round)), ExtraArgs: restoreArgs})
		if err != nil {
			return "restore", logError(err)
		}
		cur = res.PID
		current.Store(int64(cur))
		defer killTree(cur)
		if guard == "zero" {
			if sup, err = madvguard.SpawnSupervisor(cur); err != nil {
				return "restore", fmt.Sprintf("madvise supervisor: %v", err)
			}
		}
	}
	after, err := visible(cur, r.loop.MapDir)
	if err != nil {
		return "state", err.Error()
	}
	if diff := before.diff(after, cur-pid); diff != "" {
		r.stop(t, cur)
		return "state", diff
	}
	if err := r.stop(t, cur); err != nil {
		return "exit", err.Error()
	}
	out := r.outFile(t)
	for _, w := range strings.Fields(out) {
		if w == "PASS" {
			return "PASS", ""
		}
	}
	return "FAIL", oneLine(tail(out, 3))
}

func (r *runner) outFile(t string) string {
	b, _ := os.ReadFile(filepath.Join(r.static, t+".out"))
	return string(b)
}

func (r *runner) pid(t string) (int, error) {
	b, err := os.ReadFile(filepath.Join(r.static, t+".pid"))
	if err != nil {
		return 0, err
	}
	return strconv.Atoi(strings.TrimSpace(string(b)))
}

// stop sends SIGTERM, as zdtm.py does, and waits for the test to finish.
func (r *runner) stop(t string, pid int) error {
	if err := unix.Kill(pid, unix.SIGTERM); err != nil {
		return fmt.Errorf("SIGTERM %d: %w", pid, err)
	}
	deadline := time.Now().Add(30 * time.Second)
	for time.Now().Before(deadline) {
		var ws unix.WaitStatus
		if wp, _ := unix.Wait4(pid, &ws, unix.WNOHANG, nil); wp == pid {
			return nil
		}
		if !procfs.Alive(pid) {
			return nil
		}
		time.Sleep(5 * time.Millisecond)
	}
	return fmt.Errorf("still running 30 s after SIGTERM")
}

// killTree kills a test's tree (what a failed run left).
func killTree(pid int) {
	if !procfs.Alive(pid) {
		return
	}
	tree, _ := procfs.Tree(pid)
	for _, p := range tree {
		unix.Kill(p, unix.SIGKILL)
	}
	criurun.Kill(pid)
	reapOrphans()
}

// reapOrphans reaps the zombies re-parented to us (we are a subreaper): a
// restore wants the dumped pids free.
func reapOrphans() {
	me := os.Getpid()
	ents, _ := os.ReadDir("/proc")
	for _, e := range ents {
		p, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		if st, err := procfs.ReadStat(p); err != nil || st.State != 'Z' || st.PPID != me {
			continue
		}
		var ws unix.WaitStatus
		unix.Wait4(p, &ws, unix.WNOHANG, nil)
	}
}

// state is zdtm.py's visible state of a tree, by pid relative to the root.
type state struct {
	procs map[int]*procState
}

type procState struct {
	fds  map[int]string
	maps []vma
}

type vma struct {
	start, end uint64
	prot       string
}

// visible reads the tree's state; mappings of files under memDir count as
// anonymous memory.
func visible(root int, memDir string) (*state, error) {
	tree, err := procfs.Tree(root)
	if err != nil {
		return nil, err
	}
	st := &state{procs: map[int]*procState{}}
	for _, p := range tree {
		ps := &procState{fds: map[int]string{}}
		ents, err := os.ReadDir(fmt.Sprintf("/proc/%d/fd", p))
		if err != nil {
			continue // gone meanwhile (a short-lived child)
		}
		for _, e := range ents {
			fd, err := strconv.Atoi(e.Name())
			if err != nil {
				continue
			}
			l, _ := os.Readlink(fmt.Sprintf("/proc/%d/fd/%d", p, fd))
			ps.fds[fd] = l
		}
		f, err := os.Open(fmt.Sprintf("/proc/%d/maps", p))
		if err != nil {
			continue
		}
		sc := bufio.NewScanner(f)
		for sc.Scan() {
			fs := strings.Fields(sc.Text())
			if len(fs) < 5 {
				continue
			}
			lo, hi, _ := strings.Cut(fs[0], "-")
			s, _ := strconv.ParseUint(lo, 16, 64)
			e, _ := strconv.ParseUint(hi, 16, 64)
			v := vma{start: s, end: e, prot: fs[1]}
			if n := len(ps.maps); n > 0 && ps.maps[n-1].end == v.start && ps.maps[n-1].prot == v.prot {
				ps.maps[n-1].end = v.end
				continue
			}
			ps.maps = append(ps.maps, v)
		}
		f.Close()
		// By pid in the tree's own pid namespace (the host's in the host
		// flavour): a restored namespace keeps those, not the host's.
		st.procs[nsPid(p)-nsPid(root)] = ps
	}
	return st, nil
}

// diff compares two states; shift is the restored root's pid minus the
// original's (0 in the host flavour).
func (a *state) diff(b *state, shift int) string {
	var keys []int
	for k := range a.procs {
		keys = append(keys, k)
	}
	sort.Ints(keys)
	if len(a.procs) != len(b.procs) {
		return fmt.Sprintf("%d processes before the dump, %d after the restore", len(a.procs), len(b.procs))
	}
	for _, k := range keys {
		pa, pb := a.procs[k], b.procs[k]
		if pb == nil {
			return fmt.Sprintf("process root+%d missing after the restore", k)
		}
		// zdtm.py compares the numbers only (a restored memfd shows
		// "/memfd:NAME", inode numbers change).
		for fd, l := range pa.fds {
			if _, ok := pb.fds[fd]; !ok {
				return fmt.Sprintf("root+%d fd %d (%q) missing", k, fd, l)
			}
		}
		for fd, l := range pb.fds {
			if _, ok := pa.fds[fd]; !ok {
				return fmt.Sprintf("root+%d fd %d (%q) appeared", k, fd, l)
			}
		}
		if len(pa.maps) != len(pb.maps) {
			return fmt.Sprintf("root+%d: %d mappings before, %d after (%s)", k, len(pa.maps), len(pb.maps), firstMapDiff(pa.maps, pb.maps))
		}
		if d := firstMapDiff(pa.maps, pb.maps); d != "" {
			return fmt.Sprintf("root+%d: %s", k, d)
		}
	}
	return ""
}

func firstMapDiff(a, b []vma) string {
	for i := 0; i < len(a) || i < len(b); i++ {
		switch {
		case i >= len(a):
			return fmt.Sprintf("new mapping %x-%x %s", b[i].start, b[i].end, b[i].prot)
		case i >= len(b):
			return fmt.Sprintf("lost mapping %x-%x %s", a[i].start, a[i].end, a[i].prot)
		case a[i] != b[i]:
			return fmt.Sprintf("mapping %x-%x %s became %x-%x %s", a[i].start, a[i].end, a[i].prot, b[i].start, b[i].end, b[i].prot)
		}
	}
	return ""
}

// readKnown reads the known differences: "TEST REASON..." a line.
func readKnown(path string) (map[string]string, error) {
	known := map[string]string{}
	b, err := os.ReadFile(path)
	if errors.Is(err, os.ErrNotExist) {
		return known, nil
	}
	if err != nil {
		return nil, err
	}
	for _, l := range strings.Split(string(b), "\n") {
		l = strings.TrimSpace(l)
		if l == "" || l[0] == '#' {
			continue
		}
		t, reason, _ := strings.Cut(l, " ")
		known[t] = strings.TrimSpace(reason)
	}
	return known, nil
}

// summary prints the counts and what differs from plain CRIU; it returns 1
// when a test passing plain fails another way, known differences aside.
func summary(rows [][]string, known map[string]string, out string) int {
	pass := make([]int, len(modes))
	var regress, knownDiff []string
	ran := 0
	for _, row := range rows {
		if row[1] == "build-failed" || row[1] == "not-run" {
			continue
		}
		ran++
		for i := range modes {
			if row[1+i] == "PASS" {
				pass[i]++
			}
		}
		if row[1] == "PASS" {
			for i := 1; i < len(modes); i++ {
				if row[1+i] == "PASS" {
					continue
				}
				r := fmt.Sprintf("%s (%s: %s)", row[0], modes[i], row[1+i])
				if why, ok := known[row[0]]; ok {
					knownDiff = append(knownDiff, r+": "+why)
				} else {
					regress = append(regress, r)
				}
			}
		}
	}
	fmt.Printf("\nzdtm: %d tests run (%d listed)\n", ran, len(rows))
	for i, m := range modes {
		fmt.Printf("  %-10s %d pass\n", m, pass[i])
	}
	fmt.Printf("results: %s\n", out)
	if len(knownDiff) > 0 {
		fmt.Printf("known differences (zdtm/known.list) (%d):\n", len(knownDiff))
		for _, r := range knownDiff {
			fmt.Println("  " + r)
		}
	}
	if len(regress) > 0 {
		fmt.Printf("pass with plain CRIU, fail through LazyFork (%d):\n", len(regress))
		for _, r := range regress {
			fmt.Println("  " + r)
		}
		return 1
	}
	fmt.Println("every test that passes with plain CRIU passes rewritten and as a fork of a fork (known differences aside)")
	return 0
}

func logError(err error) string {
	return oneLine(tail(err.Error(), 4))
}

func tail(s string, n int) string {
	ls := strings.Split(strings.TrimRight(s, "\n"), "\n")
	if len(ls) > n {
		ls = ls[len(ls)-n:]
	}
	return strings.Join(ls, "\n")
}

func oneLine(s string) string {
	s = strings.Join(strings.Fields(s), " ")
	if len(s) > 300 {
		s = s[:300] + "..."
	}
	return s
}
