package memfile_test

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"

	"github.com/containerd/errdefs"
	"github.com/lazyfork/lazyfork/criuimg"
	"github.com/lazyfork/lazyfork/internal/criurun"
	"github.com/lazyfork/lazyfork/internal/testutil"
	"github.com/lazyfork/lazyfork/memfile"
	"golang.org/x/sys/unix"
)

const (
	dataSize  = 2 << 20 // datatest's initialised array
	dataDirty = 384     // pages of it the program rewrites before the dump
)

// dataByte is byte i of datatest's array as the binary holds it (expect(i, 0)).
func dataByte(i int) byte {
	return byte((uint32(i)*2654435761)>>24) ^ byte(i>>12)
}

// buildDataTest compiles datatest into dir with its 2 MiB initialised array.
func buildDataTest(t testing.TB, dir string) string {
	t.Helper()
	cc := testutil.RequiresBinary(t, "gcc")
	var h bytes.Buffer
	fmt.Fprintf(&h, "#define DATA_SIZE %dUL\n#define DATA_INIT \"", dataSize)
	for i := 0; i < dataSize; i++ {
		if i > 0 && i%64 == 0 {
			h.WriteString("\" \\\n\"")
		}
		fmt.Fprintf(&h, "\\%03o", dataByte(i))
	}
	h.WriteString("\"\n")
	if err := os.WriteFile(filepath.Join(dir, "datainit.h"), h.Bytes(), 0o644); err != nil {
		t.Fatal(err)
	}
	src, err := filepath.Abs("testdata/datatest.c")
	if err != nil {
		t.Fatal(err)
	}
	bin := filepath.Join(dir, "datatest")
	if out, err := exec.Command(cc, "-O2", "-I", dir, "-o", bin, src).CombinedOutput(); err != nil {
		t.Fatalf("gcc: %v\n%s", err, out)
	}
	return bin
}

// startData runs datatest and waits until it has dirtied its pages.
func (e *env) startData(bin string, extra ...string) *criurun.Workload {
	e.t.Helper()
	w, err := criurun.Start(append([]string{bin, e.ctl, strconv.Itoa(dataDirty)}, extra...),
		criurun.StartOptions{Stdout: filepath.Join(e.tmp, fmt.Sprintf("out-%d", e.next()))})
	if err != nil {
		e.t.Fatal(err)
	}
	e.t.Cleanup(func() { w.Kill() })
	e.waitFor("datatest ready", func() bool {
		_, err := os.Stat(filepath.Join(e.ctl, fmt.Sprintf("ready-%d", w.PID)))
		return err == nil
	})
	return w
}

func (e *env) rewriteFiles(dir string) *memfile.Result {
	e.t.Helper()
	res, err := e.store.Rewrite(context.Background(), dir, memfile.RewriteOptions{Family: e.family, MapDir: e.famDir, FileRoot: "/"})
	if err != nil {
		e.t.Fatal(err)
	}
	e.t.Logf("rewrite %s with FileRoot /: moved %d pages, kept %d, wrote %.1f MiB, files %v",
		filepath.Base(dir), res.PagesMoved, res.PagesKept, float64(res.BytesWritten)/(1<<20), res.Files)
	return res
}

func (e *env) verifyData(pid int) {
	e.t.Helper()
	if r := e.ask(pid, syscall.SIGUSR1, "verify"); r["ok"] != "1" {
		e.t.Fatalf("pid %d: %s", pid, r["line"])
	}
}

// imagePagesOf counts the pages the image holds for writable VMAs that map
// the file at path, over all tasks (the read-only relro part of a binary
// keeps its relocated pages).
func imagePagesOf(t testing.TB, dir, path string) uint64 {
	t.Helper()
	files, err := criuimg.ReadFiles(dir)
	if err != nil {
		t.Fatal(err)
	}
	ids := map[uint64]bool{}
	for _, fe := range files.Entries {
		if fe.GetReg().GetName() == path {
			ids[uint64(fe.GetId())] = true
		}
	}
	tree, err := criuimg.ReadPstree(dir)
	if err != nil {
		t.Fatal(err)
	}
	var n uint64
	for _, task := range tree {
		mm, err := criuimg.ReadMM(dir, task.GetPid())
		if err != nil {
			t.Fatal(err)
		}
		pm, err := criuimg.ReadPagemap(dir, task.GetPid())
		if err != nil {
			t.Fatal(err)
		}
		for _, v := range mm.MM.GetVmas() {
			if v.GetStatus()&(1<<6) == 0 || !ids[v.GetShmid()] || v.GetProt()&unix.PROT_WRITE == 0 {
				continue
			}
			for _, pe := range pm.Entries {
				for k := uint64(0); k < uint64(pe.GetNrPages()); k++ {
					if va := pe.GetVaddr() + k*4096; va >= v.GetStart() && va < v.GetEnd() {
						n++
					}
				}
			}
		}
	}
	return n
}

// TestFileData: datatest's .data (a 2 MiB initialised array, 384 pages of
// it rewritten) is dumped; rewritten with FileRoot, the dirty .data mapping
// becomes a mapping of the memory file holding the binary's bytes with the
// dumped pages on top. Every copy sees exactly the right bytes (dirty and
// clean parts), its RssAnon is smaller by the dirty pages than a copy of the
// same dump rewritten without FileRoot, a copy's writes stay its own, and a
// copy of a copy is right too. A privately mapped data file the program
// writes is not a program: it stays a file mapping.
func TestFileData(t *testing.T) {
	e := newEnv(t)
	bin := buildDataTest(t, e.tmp)
	// A data file it maps privately and writes: not a program, stays as is.
	datFile := filepath.Join(e.tmp, "plain.dat")
	if err := os.WriteFile(datFile, bytes.Repeat([]byte{1}, 4*4096), 0o644); err != nil {
		t.Fatal(err)
	}
	w := e.startData(bin, datFile)
	e.verifyData(w.PID)
	withFiles, plain := e.dump(w.PID), e.dump(w.PID)
	if n := imagePagesOf(t, withFiles, bin); n < dataDirty {
		t.Fatalf("the dump holds %d pages of %s, expected at least %d", n, bin, dataDirty)
	}
	res := e.rewriteFiles(withFiles)
	resPlain := e.rewrite(plain)
	if n := imagePagesOf(t, withFiles, bin); n != 0 {
		t.Errorf("%d pages of %s left in the image", n, bin)
	}
	if n := imagePagesOf(t, withFiles, datFile); n != 1 {
		t.Errorf("%d pages of the data file %s in the image, expected its 1 dirty page (not converted)", n, datFile)
	}
	if res.PagesMoved < resPlain.PagesMoved+dataDirty {
		t.Errorf("moved %d pages with FileRoot, %d without: expected at least %d more", res.PagesMoved, resPlain.PagesMoved, dataDirty)
	}
	if n := imagePagesOf(t, plain, bin); n < dataDirty {
		t.Errorf("without FileRoot the image holds %d pages of %s, expected at least %d", n, bin, dataDirty)
	}

	a, b, a2 := e.restore(withFiles), e.restore(plain), e.restore(withFiles)
	for _, c := range []int{a, b, a2} {
		e.verifyData(c)
	}
	anonA, anonB := rssAnon(t, a), rssAnon(t, b)
	t.Logf("RssAnon right after restore: %d kB with .data converted, %d kB without", anonA>>10, anonB>>10)
	if anonA > anonB-dataDirty*4096*9/10 {
		t.Errorf("RssAnon %d kB with .data converted, %d kB without: expected about %d kB less", anonA>>10, anonB>>10, dataDirty*4)
	}
	maps, err := os.ReadFile(fmt.Sprintf("/proc/%d/maps", a))
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(string(maps), e.famDir) {
		t.Errorf("copy maps no memory file:\n%s", maps)
	}

	// A write in one copy (dirty pages and pages clean in the file) is its own.
	e.ask(a, syscall.SIGHUP, "dirty")
	e.verifyData(a)
	e.verifyData(a2)
	e.verifyData(w.PID)
	if anon := rssAnon(t, a2); anon > anonA+64<<10 {
		t.Errorf("untouched copy's RssAnon grew from %d to %d kB", anonA>>10, anon>>10)
	}

	// A copy of a copy: its .data maps the family file, the write is a delta.
	d := e.dump(a)
	e.rewriteFiles(d)
	c := e.restore(d)
	e.verifyData(c)
	e.ask(c, syscall.SIGHUP, "dirty")
	e.verifyData(c)
	e.verifyData(a)
	e.verifyData(a2)
}

// TestFileDataChanged: the binary is edited in place after the dump (same
// size, mode and build-id, only a clean page of .data differs): the rewrite
// must leave the .data mapping as it is, pages in the image, rather than
// copy the new bytes. With the old bytes back, the image restores right.
func TestFileDataChanged(t *testing.T) {
	e := newEnv(t)
	bin := buildDataTest(t, e.tmp)
	w := e.startData(bin)
	dir := e.dump(w.PID)
	if err := w.Kill(); err != nil {
		t.Fatal(err)
	}
	content, err := os.ReadFile(bin)
	if err != nil {
		t.Fatal(err)
	}
	want := make([]byte, 4096)
	for i := range want {
		want[i] = dataByte(i)
	}
	off := bytes.Index(content, want)
	if off < 0 {
		t.Fatal("array not found in the binary")
	}
	// A page the program never wrote: the copy would read it from the file.
	at := int64(off + dataSize - 4096)
	orig := append([]byte(nil), content[at:at+4096]...)
	edit := bytes.Repeat([]byte{0xEE}, 4096)
	writeAt(t, bin, edit, at)

	// A relative root is refused, and leaves the image as it was.
	if _, err := e.store.Rewrite(context.Background(), dir, memfile.RewriteOptions{Family: e.family, MapDir: e.famDir, FileRoot: "rel"}); !errdefs.IsInvalidArgument(err) {
		t.Fatalf("rewrite with a relative FileRoot: %v, expected invalid argument", err)
	}
	if _, err := memfile.ReadSnapshot(dir); !errdefs.IsNotFound(err) {
		t.Fatalf("failed rewrite left a snapshot: %v", err)
	}
	res := e.rewriteFiles(dir)
	if n := imagePagesOf(t, dir, bin); n < dataDirty {
		t.Fatalf("the edited file's .data was converted: %d of its pages left in the image (rewrite %+v)", n, res)
	}
	writeAt(t, bin, orig, at)
	c := e.restore(dir)
	e.verifyData(c)
}

func writeAt(t testing.TB, path string, b []byte, off int64) {
	t.Helper()
	f, err := os.OpenFile(path, os.O_WRONLY, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if _, err := f.WriteAt(b, off); err != nil {
		t.Fatal(err)
	}
}

// TestFileDataTree: a tree (a child and a chain below it) rewritten with
// FileRoot: every task's dirty .data mappings (libc's, the program's) move
// into the memory file, children share their parent's slot where their
// pages agree, and every process of a copy and of a copy of a copy passes
// its memory check.
func TestFileDataTree(t *testing.T) {
	e := newEnv(t)
	orig := e.startChain(16, 1, 3)
	dir := e.dump(orig)
	e.rewriteFiles(dir)
	if n := imagePagesOf(t, dir, e.bin); n != 0 {
		t.Errorf("%d pages of %s left in the image", n, e.bin)
	}
	c := e.restore(dir)
	e.verifyTree(c)
	e.ask(c, syscall.SIGHUP, "dirty")
	e.verifyTree(c)
	d := e.dump(c)
	e.rewriteFiles(d)
	e.verifyTree(e.restore(d))
	e.verifyTree(orig)
}
