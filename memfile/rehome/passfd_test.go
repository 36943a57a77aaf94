package rehome

import (
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"

	"golang.org/x/sys/unix"
)

// A process that sees the memory file only through a read-only mount (a
// container's memory view) still writes its pages itself, through a
// descriptor the tracer passes it, and maps the file by the path it sees;
// it is left with no descriptor it did not have.
func TestMoveFileReadOnlyViewWritesByProcess(t *testing.T) {
	dir := tmpfs(t)
	view := filepath.Join(t.TempDir(), "view")
	if err := os.Mkdir(view, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := unix.Mount(dir, view, "", unix.MS_BIND, ""); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { unix.Unmount(view, unix.MNT_DETACH) })
	if err := unix.Mount("", view, "", unix.MS_BIND|unix.MS_REMOUNT|unix.MS_RDONLY, ""); err != nil {
		t.Fatal(err)
	}
	host, err := os.Create(filepath.Join(dir, "mem"))
	if err != nil {
		t.Fatal(err)
	}
	defer host.Close()
	path := filepath.Join(view, "mem")
	if f, err := os.OpenFile(path, os.O_RDWR, 0); err == nil {
		f.Close()
		t.Fatalf("%s is writable: the view is not read-only", path)
	}

	p := startProg(t, 32)
	ticks, t1, t2 := p.verify()
	fdsBefore := openFDs(t, p.pid)
	tr, vmas := seizePlanned(t, p)
	done, st, err := tr.MoveFile(p.pid, host, path, vmas, 0)
	if derr := tr.Detach(); derr != nil {
		t.Error(derr)
	}
	if err != nil || len(done) != len(vmas) {
		t.Fatalf("MoveFile: %d of %d VMAs: %v", len(done), len(vmas), err)
	}
	t.Logf("%+v", st)
	if st.ByTracer > st.Bytes/10 || st.Calls == 0 {
		t.Errorf("the tracer copied (%+v): the process did not write through the passed descriptor", st)
	}
	waitTicks(t, p, ticks, t1, t2)
	if hdr, _ := smapsEntry(t, p.pid, p.heap[0]); !strings.HasSuffix(hdr, path) {
		t.Errorf("heap maps %q, want the view's path %s", hdr, path)
	}
	if after := openFDs(t, p.pid); after != fdsBefore {
		t.Errorf("the process holds descriptors %s after the move, %s before", after, fdsBefore)
	}
}

// openFDs lists process pid's descriptors and what they name.
func openFDs(t *testing.T, pid int) string {
	t.Helper()
	dir := filepath.Join("/proc", strconv.Itoa(pid), "fd")
	ents, err := os.ReadDir(dir)
	if err != nil {
		t.Fatal(err)
	}
	var out []string
	for _, e := range ents {
		l, _ := os.Readlink(filepath.Join(dir, e.Name()))
		out = append(out, e.Name()+"="+l)
	}
	return strings.Join(out, " ")
}
