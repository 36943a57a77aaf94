package criuimg_test

import (
	"bytes"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"syscall"
	"testing"
	"time"

	"github.com/checkpoint-restore/go-criu/v7/magic"
	"github.com/lazyfork/lazyfork/criuimg"
	"github.com/lazyfork/lazyfork/internal/testutil"
)

// TestMagicsMatchGoCRIU keeps our constants honest against go-criu's table.
func TestMagicsMatchGoCRIU(t *testing.T) {
	m := magic.LoadMagic()
	for _, k := range criuimg.Kinds {
		if got := m.ByName[k.Name]; uint32(got) != k.Magic {
			t.Errorf("%s: magic %#x, go-criu says %#x", k.Name, k.Magic, got)
		}
	}
	if uint32(m.ByName["IMG_COMMON"]) != criuimg.MagicCommon || uint32(m.ByName["IMG_SERVICE"]) != criuimg.MagicService {
		t.Errorf("head magics differ from go-criu")
	}
}

// dumpTree compiles testdata/tree.c, starts it as the init of a new PID
// namespace, dumps it with the real CRIU and returns the image directory.
func dumpTree(t *testing.T) string {
	t.Helper()
	criu := testutil.RequiresCRIU(t)
	cc := testutil.RequiresBinary(t, "gcc")
	tmp := t.TempDir()
	bin := filepath.Join(tmp, "tree")
	if out, err := exec.Command(cc, "-O2", "-pthread", "-o", bin, "testdata/tree.c").CombinedOutput(); err != nil {
		t.Fatalf("gcc: %v\n%s", err, out)
	}
	ready := filepath.Join(tmp, "ready")
	cmd := exec.Command("unshare", "--pid", "--fork", "--kill-child", "setsid", bin, ready)
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL)
		cmd.Wait()
	})
	deadline := time.Now().Add(10 * time.Second)
	for !criuimg.Exists(ready) {
		if time.Now().After(deadline) {
			t.Fatal("workload did not become ready")
		}
		time.Sleep(10 * time.Millisecond)
	}
	// The namespace init is unshare's only child.
	kids, err := os.ReadFile("/proc/" + strconv.Itoa(cmd.Process.Pid) + "/task/" + strconv.Itoa(cmd.Process.Pid) + "/children")
	if err != nil {
		t.Fatal(err)
	}
	pid := string(bytes.TrimSpace(kids))
	dir := filepath.Join(tmp, "img")
	if err := os.Mkdir(dir, 0o700); err != nil {
		t.Fatal(err)
	}
	if out, err := exec.Command(criu, "dump", "-t", pid, "-D", dir, "--leave-running", "--shell-job", "-o", "dump.log").CombinedOutput(); err != nil {
		log, _ := os.ReadFile(filepath.Join(dir, "dump.log"))
		t.Fatalf("criu dump: %v\n%s\n%s", err, out, log)
	}
	return dir
}

func TestRoundTripRealDump(t *testing.T) {
	dir := dumpTree(t)
	ents, err := os.ReadDir(dir)
	if err != nil {
		t.Fatal(err)
	}
	known := 0
	for _, e := range ents {
		k := criuimg.KindOf(e.Name())
		if k == nil {
			t.Logf("not decoded: %s", e.Name())
			continue
		}
		path := filepath.Join(dir, e.Name())
		orig, err := os.ReadFile(path)
		if err != nil {
			t.Fatal(err)
		}
		img, err := criuimg.ReadImage(path, k.Magic, k.NewEntry)
		if err != nil {
			t.Fatalf("%s: %v", e.Name(), err)
		}
		again, err := img.Bytes()
		if err != nil {
			t.Fatalf("%s: %v", e.Name(), err)
		}
		if !bytes.Equal(orig, again) {
			t.Errorf("%s: re-encoded image differs (%d bytes vs %d)", e.Name(), len(again), len(orig))
		}
		known++
	}
	if known < 10 {
		t.Errorf("only %d images decoded", known)
	}

	// Typed readers agree with the files: two tasks, pages file as long as the pagemap says.
	tree, err := criuimg.ReadPstree(dir)
	if err != nil {
		t.Fatal(err)
	}
	if len(tree) != 2 || len(tree[0].Threads) != 2 {
		t.Fatalf("pstree: %v", tree)
	}
	for _, task := range tree {
		pm, err := criuimg.ReadPagemap(dir, task.GetPid())
		if err != nil {
			t.Fatal(err)
		}
		_, total := pm.Offsets()
		p, err := criuimg.OpenPages(dir, pm.PagesID, total)
		if err != nil {
			t.Fatal(err)
		}
		if p.Size != total {
			t.Errorf("pid %d: pages file %d bytes, pagemap accounts for %d", task.GetPid(), p.Size, total)
		}
		p.Close()
		if _, err := criuimg.ReadMM(dir, task.GetPid()); err != nil {
			t.Fatal(err)
		}
	}
}
