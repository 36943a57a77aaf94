package ckptarchive

import (
	"archive/tar"
	"io"
	"os"
	"path/filepath"
	"testing"

	"github.com/containerd/errdefs"
)

func writeTar(t *testing.T, entries map[string]string) string {
	t.Helper()
	p := filepath.Join(t.TempDir(), "a.tar")
	f, err := os.Create(p)
	if err != nil {
		t.Fatal(err)
	}
	tw := tar.NewWriter(f)
	for name, body := range entries {
		if err := tw.WriteHeader(&tar.Header{Name: name, Mode: 0o600, Size: int64(len(body)), Typeflag: tar.TypeReg}); err != nil {
			t.Fatal(err)
		}
		if _, err := io.WriteString(tw, body); err != nil {
			t.Fatal(err)
		}
	}
	if err := tw.Close(); err != nil {
		t.Fatal(err)
	}
	return p
}

// Image entries land in dst, names that climb out are skipped, Extra reads
// its entry, and every byte counts against the budget.
func TestUnpack(t *testing.T) {
	p := writeTar(t, map[string]string{
		"checkpoint/inventory.img":        "inv",
		"./checkpoint/core-1.img":         "core",
		"checkpoint/../escape.img":        "no",
		"checkpoint/sub/deep.img":         "no",
		"checkpoint/parent/pagemap-7.img": "pm",
		"rootfs-diff.tar":                 "layer",
		"config.dump":                     "{}",
	})
	dst := t.TempDir()
	var layer []byte
	n, err := Unpack(p, dst, Options{Budget: 1 << 20, Extra: map[string]func(io.Reader) error{
		"rootfs-diff.tar": func(r io.Reader) (err error) { layer, err = io.ReadAll(r); return err },
	}})
	if err != nil || n != 3 {
		t.Fatalf("Unpack: %d entries, %v; want 3", n, err)
	}
	if string(layer) != "layer" {
		t.Errorf("Extra read %q", layer)
	}
	ents, _ := os.ReadDir(dst)
	if len(ents) != 3 {
		t.Errorf("dst holds %v, want inventory.img, core-1.img and parent/", ents)
	}
	// The premap parent pagemap a rewrite writes for a task with many
	// mappings travels with the image.
	if b, err := os.ReadFile(filepath.Join(dst, "parent", "pagemap-7.img")); err != nil || string(b) != "pm" {
		t.Errorf("parent pagemap: %q %v", b, err)
	}
	if _, err := os.Stat(filepath.Join(filepath.Dir(dst), "escape.img")); err == nil {
		t.Error("an entry climbed out of dst")
	}
	// 3 + 4 + 2 + 5 bytes: a budget of 10 refuses one.
	if _, err := Unpack(p, t.TempDir(), Options{Budget: 10, Extra: map[string]func(io.Reader) error{
		"rootfs-diff.tar": func(r io.Reader) error { _, err := io.Copy(io.Discard, r); return err },
	}}); !errdefs.IsResourceExhausted(err) {
		t.Errorf("over budget: %v, want resource exhausted", err)
	}
}
