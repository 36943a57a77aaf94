package memfile_test

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"io/fs"
	"math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/containerd/errdefs"
	"github.com/lazyfork/lazyfork/criuimg"
	"github.com/lazyfork/lazyfork/memfile"
)

// treeHash fingerprints every file of a directory (names, modes, contents).
func treeHash(t testing.TB, dir string) string {
	t.Helper()
	h := sha256.New()
	err := filepath.WalkDir(dir, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		rel, _ := filepath.Rel(dir, p)
		info, _ := d.Info()
		fmt.Fprintf(h, "%s %v\n", rel, info.Mode())
		if d.Type().IsRegular() {
			b, err := os.ReadFile(p)
			if err != nil {
				return err
			}
			h.Write(b)
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	return hex.EncodeToString(h.Sum(nil))
}

func copyDir(t testing.TB, src, dst string) {
	t.Helper()
	if out, err := exec.Command("cp", "-a", src, dst).CombinedOutput(); err != nil {
		t.Fatalf("cp: %v %s", err, out)
	}
}

// familyFiles lists the family directory.
func familyFiles(t testing.TB, dir string) []string {
	ents, _ := os.ReadDir(dir)
	var out []string
	for _, e := range ents {
		out = append(out, e.Name())
	}
	return out
}

// TestBadImages: corrupt images give clear errors and leave the image
// directory and the family exactly as they were.
func TestBadImages(t *testing.T) {
	e := newEnv(t)
	orig := e.dump(e.start(8, 1))
	cases := []struct {
		name   string
		break_ func(dir string)
		want   error
		substr string
	}{
		{"truncated pages", func(d string) { os.Truncate(criuimg.PagesPath(d, 1), 4096*3) }, errdefs.ErrDataLoss, "truncated"},
		{"truncated pagemap", func(d string) {
			st, _ := os.Stat(criuimg.PagemapPath(d, 1))
			os.Truncate(criuimg.PagemapPath(d, 1), st.Size()-3)
		}, errdefs.ErrDataLoss, "truncated"},
		{"bad magic", func(d string) {
			b, _ := os.ReadFile(criuimg.MMPath(d, 2))
			b[5] ^= 0xff
			os.WriteFile(criuimg.MMPath(d, 2), b, 0o644)
		}, errdefs.ErrInvalidArgument, "bad magic"},
		{"missing files.img", func(d string) { os.Remove(criuimg.FilesPath(d)) }, errdefs.ErrNotFound, "files.img"},
		{"missing pages", func(d string) { os.Remove(criuimg.PagesPath(d, 2)) }, errdefs.ErrNotFound, "pages-2.img"},
		{"missing mm of a live task", func(d string) { os.Remove(criuimg.MMPath(d, 2)) }, errdefs.ErrNotFound, "mm-2.img"},
		{"garbage pstree", func(d string) {
			os.WriteFile(criuimg.PstreePath(d), []byte{0x19, 0x43, 0x56, 0x54, 0x30, 0x30, 0x27, 0x50, 200, 0, 0, 0, 1, 2}, 0o644)
		}, errdefs.ErrDataLoss, "pstree.img"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			dir := filepath.Join(e.tmp, "bad-"+strings.ReplaceAll(c.name, " ", "-"))
			copyDir(t, orig, dir)
			c.break_(dir)
			before := treeHash(t, dir)
			famBefore := familyFiles(t, e.famDir)
			_, err := e.store.Rewrite(context.Background(), dir, memfile.RewriteOptions{Family: e.family, MapDir: e.famDir})
			if err == nil || !errors.Is(err, c.want) || !strings.Contains(err.Error(), c.substr) {
				t.Fatalf("error %v, expected %v mentioning %q", err, c.want, c.substr)
			}
			t.Logf("%s: %v", c.name, err)
			if treeHash(t, dir) != before {
				t.Error("image directory changed")
			}
			if got := familyFiles(t, e.famDir); fmt.Sprint(got) != fmt.Sprint(famBefore) {
				t.Errorf("family dir changed: %v -> %v", famBefore, got)
			}
			if left, _ := filepath.Glob(dir + ".lazyfork-stage-*"); len(left) != 0 {
				t.Errorf("staging left behind: %v", left)
			}
		})
	}

	// A snapshot is not rewritten twice; a cancelled rewrite changes nothing.
	dir := filepath.Join(e.tmp, "twice")
	copyDir(t, orig, dir)
	e.rewrite(dir)
	if _, err := e.store.Rewrite(context.Background(), dir, memfile.RewriteOptions{Family: e.family, MapDir: e.famDir}); !errors.Is(err, errdefs.ErrAlreadyExists) {
		t.Errorf("second rewrite: %v", err)
	}
	dir = filepath.Join(e.tmp, "cancelled")
	copyDir(t, orig, dir)
	before := treeHash(t, dir)
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	if _, err := e.store.Rewrite(ctx, dir, memfile.RewriteOptions{Family: e.family, MapDir: e.famDir}); !errors.Is(err, context.Canceled) {
		t.Errorf("cancelled rewrite: %v", err)
	}
	if treeHash(t, dir) != before {
		t.Error("cancelled rewrite changed the image")
	}
	// A failing Stage hook (it sees the complete staged image) aborts cleanly.
	famBefore := familyFiles(t, e.famDir)
	var staged string
	_, err := e.store.Rewrite(context.Background(), dir, memfile.RewriteOptions{Family: e.family, MapDir: e.famDir,
		Stage: func(_ context.Context, d string) error {
			if _, err := memfile.ReadSnapshot(d); err != nil {
				return err
			}
			staged = d
			return errdefs.ErrUnavailable
		}})
	if !errors.Is(err, errdefs.ErrUnavailable) || staged == "" {
		t.Errorf("stage hook error: %v (staged %q)", err, staged)
	}
	if treeHash(t, dir) != before || fmt.Sprint(familyFiles(t, e.famDir)) != fmt.Sprint(famBefore) {
		t.Error("failed stage hook changed the image or the family")
	}
	if _, err := os.Stat(staged); err == nil {
		t.Error("staging directory left behind")
	}
	if _, err := e.store.Rewrite(context.Background(), dir, memfile.RewriteOptions{Family: "bad/name", MapDir: e.famDir}); !errors.Is(err, errdefs.ErrInvalidArgument) {
		t.Errorf("bad family: %v", err)
	}
	if _, err := e.store.Rewrite(context.Background(), dir, memfile.RewriteOptions{Family: e.family, MapDir: "rel/dir"}); !errors.Is(err, errdefs.ErrInvalidArgument) {
		t.Errorf("relative MapDir: %v", err)
	}
}

const crashEnv = "MEMFILE_TEST_CRASH_REWRITE"

// TestMain lets the crash test run a rewrite in a child process it can kill.
func TestMain(m *testing.M) {
	if spec := os.Getenv(crashEnv); spec != "" {
		f := strings.Split(spec, "|")
		s, err := memfile.OpenStore(f[0])
		if err == nil {
			_, err = s.Rewrite(context.Background(), f[1], memfile.RewriteOptions{Family: f[2], MapDir: f[3]})
		}
		if err != nil {
			fmt.Fprintln(os.Stderr, err)
			os.Exit(1)
		}
		os.Exit(0)
	}
	os.Exit(m.Run())
}

// TestRewriteKilled: a rewrite killed at any moment leaves either the old
// image, intact, or the complete snapshot, which restores; GC then removes
// whatever the dead rewrite left in the family.
func TestRewriteKilled(t *testing.T) {
	e := newEnv(t)
	orig := e.dump(e.start(32, 1))
	origHash := treeHash(t, orig)
	self, _ := os.Executable()
	child := func(dir string) *exec.Cmd {
		cmd := exec.Command(self, "-test.run=^$")
		cmd.Env = append(os.Environ(), crashEnv+"="+strings.Join([]string{e.store.Root(), dir, e.family, e.famDir}, "|"))
		cmd.Stderr = os.Stderr
		return cmd
	}
	// How long a whole rewrite takes in a child, to spread the kills over it.
	full := filepath.Join(e.tmp, "crash-full")
	copyDir(t, orig, full)
	t0 := time.Now()
	if err := child(full).Run(); err != nil {
		t.Fatal(err)
	}
	span := time.Since(t0)
	var sawOld, sawNew bool
	const kills = 10
	for i := 0; i < kills; i++ {
		dir := filepath.Join(e.tmp, fmt.Sprintf("crash-%d", i))
		copyDir(t, orig, dir)
		cmd := child(dir)
		if err := cmd.Start(); err != nil {
			t.Fatal(err)
		}
		time.Sleep(time.Duration(rand.Int64N(int64(span) * 12 / 10)))
		cmd.Process.Signal(syscall.SIGKILL)
		cmd.Wait()
		if _, err := memfile.ReadSnapshot(dir); err == nil {
			sawNew = true
			checkNoAnonPages(t, dir)
			if !sawOld || i%4 == 0 {
				e.verifyTree(e.restore(dir))
			}
			continue
		}
		if treeHash(t, dir) != origHash {
			t.Fatalf("kill %d: image is neither the old one nor a snapshot", i)
		}
		sawOld = true
		// The old image still rewrites and restores.
		if i%4 == 1 {
			e.rewrite(dir)
			e.verifyTree(e.restore(dir))
		}
	}
	t.Logf("a rewrite takes %v in a child; after kills saw old images: %v, complete snapshots: %v", span, sawOld, sawNew)
	// Nothing half-written survives a GC, and every live snapshot's files do.
	if _, err := e.store.GC(context.Background()); err != nil {
		t.Fatal(err)
	}
	for _, n := range familyFiles(t, e.famDir) {
		if strings.HasPrefix(n, ".tmp-") {
			t.Errorf("left behind: %s", n)
		}
	}
	for i := 0; i < kills; i++ {
		dir := filepath.Join(e.tmp, fmt.Sprintf("crash-%d", i))
		if info, err := memfile.ReadSnapshot(dir); err == nil {
			for _, f := range info.Files {
				if _, err := os.Stat(filepath.Join(e.famDir, f)); err != nil {
					t.Errorf("snapshot %s lost its file %s", dir, f)
				}
			}
		}
	}
}
