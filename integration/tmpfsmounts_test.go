package integration

import (
	"context"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	containerd "github.com/containerd/containerd/v2/client"

	lfclient "github.com/lazyfork/lazyfork/client"
	"github.com/lazyfork/lazyfork/integration/harness"
)

// tarSpy is a directory holding a `tar` that logs each run's arguments to
// its log file and then runs the real tar: put first in the shims' PATH,
// it sees every tar CRIU runs for them (runc and CRIU inherit the PATH).
type tarSpy struct {
	dir, log string
}

func newTarSpy(t *testing.T) *tarSpy {
	t.Helper()
	dir := t.TempDir()
	s := &tarSpy{dir: dir, log: filepath.Join(dir, "tar.log")}
	real := "/usr/bin/tar"
	if _, err := os.Stat(real); err != nil {
		real = "/bin/tar"
	}
	script := "#!/bin/sh\necho \"$*\" >>" + s.log + "\nexec " + real + " \"$@\"\n"
	if err := os.WriteFile(filepath.Join(dir, "tar"), []byte(script), 0o755); err != nil {
		t.Fatal(err)
	}
	return s
}

// extracts is how many `tar --extract` runs the log holds.
func (s *tarSpy) extracts(t *testing.T) int {
	return strings.Count(spyLog(t, s.log), "--extract")
}

// spyLog is what a spy wrapper logged so far ("" before its first run).
func spyLog(t *testing.T, path string) string {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil && !os.IsNotExist(err) {
		t.Fatal(err)
	}
	return string(b)
}

// reset forgets the runs logged so far.
func (s *tarSpy) reset(t *testing.T) {
	t.Helper()
	if err := os.Remove(s.log); err != nil && !os.IsNotExist(err) {
		t.Fatal(err)
	}
}

// sh runs a shell script in task and returns its output; it must succeed.
func (e *lfEnv) sh(t *testing.T, ctx context.Context, task containerd.Task, script string) string {
	t.Helper()
	out, code, err := e.execOut(ctx, task, "sh", "-c", script)
	if err != nil || code != 0 {
		t.Fatalf("%s: sh -c %q: %v (exit %d) %s", task.ID(), script, err, code, out)
	}
	return strings.TrimSpace(out)
}

// tmpfsView is what a task sees of its tmpfs mounts mounted at their root
// (not the binds of a file or directory in one): per mount point, the line
// "mountpoint fstype source mount-options super-options mode:uid:gid entries"
// (its root directory's mode and owner, and how many entries it holds), and
// the superblocks (major:minor) that hold something.
type tmpfsView struct {
	lines []string
	full  map[string]bool
}

func (e *lfEnv) tmpfsView(t *testing.T, ctx context.Context, task containerd.Task) tmpfsView {
	t.Helper()
	out := e.sh(t, ctx, task, `sed 's/ - / /' /proc/self/mountinfo | while read id par dev root mp mo rest; do
		set -- $rest
		while [ $# -gt 3 ]; do shift; done
		[ "$1" = tmpfs ] && [ "$root" = / ] || continue
		echo "$dev $mp $1 $2 $mo $3 $(stat -c %a:%u:%g "$mp") $(ls -A "$mp" | wc -l)"
	done`)
	v := tmpfsView{full: map[string]bool{}}
	for _, l := range strings.Split(out, "\n") {
		dev, line, _ := strings.Cut(l, " ")
		v.lines = append(v.lines, line)
		if !strings.HasSuffix(line, " 0") {
			v.full[dev] = true
		}
	}
	slices.Sort(v.lines)
	return v
}

// TestForkEmptyTmpfsMounts: a fork's tmpfs mounts (/dev, /dev/shm, /run, the
// masked /proc/acpi and /sys/firmware) are the parent's: same options, root
// directory mode and owner, and contents; writable and each fork's own. No
// fork runs the real tar: CRIU runs tar only for mounts that hold something
// (/dev's device nodes; /dev/shm and /run when the parent wrote a file into
// each, which its forks see), and LazyFork's CRIU proxy, first on CRIU's PATH
// as tar, extracts those small archives itself (cmd/lazyfork-criu-proxy).
func TestForkEmptyTmpfsMounts(t *testing.T) {
	spy := newTarSpy(t)
	e := startLF(t, harness.Options{BinDirs: []string{spy.dir}})
	ctx := e.ctx(t)
	img, err := e.ImportImage(ctx, "python")
	if err != nil {
		t.Fatal(err)
	}
	lf := e.lfClient()
	for _, c := range []struct {
		name   string
		script string   // run in the parent before the snapshot
		files  []string // what the forks find in /dev/shm and /run
	}{
		{"empty", "true", nil},
		{"written", "echo shm-data >/dev/shm/parent-file && echo run-data >/run/parent-file", []string{"/dev/shm/parent-file shm-data", "/run/parent-file run-data"}},
	} {
		t.Run(c.name, func(t *testing.T) {
			_, parent := e.run(t, ctx, img, c.name, []string{"sleep", "infinity"})
			e.sh(t, ctx, parent, c.script)
			pv := e.tmpfsView(t, ctx, parent)
			t.Logf("parent's tmpfs mounts:\n%s", strings.Join(pv.lines, "\n"))
			for _, mp := range []string{"/dev", "/dev/shm", "/run"} {
				if !slices.ContainsFunc(pv.lines, func(l string) bool { return strings.HasPrefix(l, mp+" ") }) {
					t.Fatalf("the parent has no tmpfs at %s", mp)
				}
			}
			snap, err := lf.Checkpoint(ctx, c.name)
			if err != nil {
				t.Fatal(err)
			}
			spy.reset(t)
			ids := []string{c.name + "-a", c.name + "-b"}
			forks, err := lf.RestoreForks(ctx, c.name, snap.Snapshot, 2, e.logIO(), lfclient.WithIDs(ids...))
			if err != nil {
				t.Fatal(err)
			}
			// The proxy extracted what CRIU untars: the spy (the real tar,
			// behind the proxy on the PATH) never ran.
			if got := spy.extracts(t); got != 0 {
				b, _ := os.ReadFile(spy.log)
				t.Errorf("restoring %d forks ran the real tar --extract %d times, want 0 (%d tmpfs mounts of the parent hold something; the CRIU proxy extracts them):\n%s",
					len(forks), got, len(pv.full), b)
			}
			for _, f := range forks {
				fv := e.tmpfsView(t, ctx, f.Task)
				if !slices.Equal(fv.lines, pv.lines) {
					t.Errorf("%s's tmpfs mounts:\n%s\nthe parent's:\n%s", f.Container.ID(), strings.Join(fv.lines, "\n"), strings.Join(pv.lines, "\n"))
				}
				got := e.sh(t, ctx, f.Task, `for f in /dev/shm/* /run/*; do [ -e "$f" ] && echo "$f $(cat "$f")"; done; true`)
				if want := strings.Join(c.files, "\n"); got != want {
					t.Errorf("%s finds in /dev/shm and /run:\n%s\nwant:\n%s", f.Container.ID(), got, want)
				}
			}
			// Writable, and each fork's own.
			a, b := forks[0].Task, forks[1].Task
			e.sh(t, ctx, a, "echo mine >/dev/shm/fork-a && echo mine >/run/fork-a && mkdir /dev/shm/d-a")
			for _, task := range []containerd.Task{b, parent} {
				if out := e.sh(t, ctx, task, "ls -A /dev/shm /run"); strings.Contains(out, "-a") {
					t.Errorf("%s sees fork %s's files:\n%s", task.ID(), a.ID(), out)
				}
			}
			if out := e.sh(t, ctx, a, "cat /dev/shm/fork-a /run/fork-a"); out != "mine\nmine" {
				t.Errorf("fork %s reads back %q", a.ID(), out)
			}
			if err := lf.RemoveSnapshot(ctx, snap.Snapshot); err != nil {
				t.Error(err)
			}
		})
	}
}
