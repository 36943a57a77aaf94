package memfile_test

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"testing"

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

// TestMain lets the crash test run a rewrite in a child process that kills
// itself at a fault point.
func TestMain(m *testing.M) {
	if spec := os.Getenv(crashEnv); spec != "" {
		f := strings.Split(spec, "|")
		s, err := memfile.OpenStore(f[0])
		if err == nil {
			memfile.SetFault(s, func(point string) error {
				if point == f[4] {
					syscall.Kill(os.Getpid(), syscall.SIGKILL)
					select {}
				}
				return nil
			})
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

// checkStore checks what a failed or killed rewrite of dir left, once GC
// and a new Rewrite of dir (which completes the old image, or refuses the
// snapshot) have run: dir is a whole snapshot, nothing lies beside it, and
// the family holds exactly the snapshot's files, with one holder.
func checkStore(t *testing.T, s *memfile.Store, dir, family string) {
	t.Helper()
	if _, err := s.GC(context.Background()); err != nil {
		t.Fatal(err)
	}
	_, err := s.Rewrite(context.Background(), dir, memfile.RewriteOptions{Family: family, MapDir: "/mem"})
	if err != nil && !errdefs.IsAlreadyExists(err) {
		t.Fatalf("rewrite after the fault: %v", err)
	}
	info, err := memfile.ReadSnapshot(dir)
	if err != nil {
		t.Fatalf("no snapshot after the fault: %v", err)
	}
	checkNoAnonPages(t, dir)
	beside, _ := filepath.Glob(dir + "?*")
	if len(beside) > 0 {
		t.Errorf("left beside the image: %v", beside)
	}
	if _, err := s.GC(context.Background()); err != nil {
		t.Fatal(err)
	}
	files := familyFiles(t, filepath.Join(s.Root(), family))
	if !slices.Equal(files, info.Files) {
		t.Errorf("family holds %v, the snapshot maps %v", files, info.Files)
	}
	if h, _ := s.Holders(family); len(h) != 1 {
		t.Errorf("holders %v, want the snapshot's only", h)
	}
}

// tinyFaultEnv unpacks the committed tiny dump and opens a store for it:
// the image directory, the image's hash, the store.
func tinyFaultEnv(t *testing.T) (dir, hash string, s *memfile.Store) {
	dir = memfile.ExtractDump(t, "tiny.tar.gz")
	root := t.TempDir()
	t.Cleanup(func() { memfile.RemoveAll(root) })
	s, err := memfile.OpenStore(root)
	if err != nil {
		t.Fatal(err)
	}
	return dir, treeHash(t, dir), s
}

// TestRewriteFaults: a rewrite that fails at any step of its commit leaves
// the old image exactly as it was, no file in the family and no holder; a
// rewrite of it then succeeds. Root-free (the committed tiny dump).
func TestRewriteFaults(t *testing.T) {
	for _, point := range memfile.FaultPoints[:len(memfile.FaultPoints)-1] {
		t.Run(point, func(t *testing.T) {
			dir, orig, s := tinyFaultEnv(t)
			root := s.Root()
			injected := errors.New("injected")
			var reached []string
			memfile.SetFault(s, func(p string) error {
				reached = append(reached, p)
				if p == point {
					return injected
				}
				return nil
			})
			_, err := s.Rewrite(context.Background(), dir, memfile.RewriteOptions{Family: "fam", MapDir: "/mem"})
			if !errors.Is(err, injected) || reached[len(reached)-1] != point {
				t.Fatalf("rewrite with a fault at %s: %v (reached %v)", point, err, reached)
			}
			if treeHash(t, dir) != orig {
				t.Errorf("image changed by a rewrite that failed at %s", point)
			}
			if files := familyFiles(t, filepath.Join(root, "fam")); len(files) > 0 {
				t.Errorf("failed rewrite left %v in the family", files)
			}
			if h, _ := s.Holders("fam"); len(h) > 0 {
				t.Errorf("failed rewrite left holders %v", h)
			}
			memfile.SetFault(s, nil)
			checkStore(t, s, dir, "fam")
		})
	}
}

// TestRewriteKilled: a rewrite killed at any step of its commit leaves the
// old image, intact, up to the swap and the complete snapshot after it;
// GC and the next Rewrite of the directory remove whatever the dead rewrite
// left. Root-free (the committed tiny dump).
func TestRewriteKilled(t *testing.T) {
	self, _ := os.Executable()
	for i, point := range memfile.FaultPoints {
		t.Run(point, func(t *testing.T) {
			dir, orig, s := tinyFaultEnv(t)
			root := s.Root()
			cmd := exec.Command(self, "-test.run=^$")
			cmd.Env = append(os.Environ(), crashEnv+"="+strings.Join([]string{root, dir, "fam", "/mem", point}, "|"))
			err := cmd.Run()
			var ee *exec.ExitError
			if !errors.As(err, &ee) || ee.Sys().(syscall.WaitStatus).Signal() != syscall.SIGKILL {
				t.Fatalf("the rewrite was not killed at %s: %v", point, err)
			}
			_, snapErr := memfile.ReadSnapshot(dir)
			if swapped := i == len(memfile.FaultPoints)-1; swapped != (snapErr == nil) {
				t.Fatalf("killed at %s: snapshot in place %v, want %v", point, snapErr == nil, swapped)
			}
			if snapErr != nil && treeHash(t, dir) != orig {
				t.Fatalf("killed at %s: the image is neither the old one nor a snapshot", point)
			}
			checkStore(t, s, dir, "fam")
		})
	}
}
