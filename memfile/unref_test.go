package memfile_test

import (
	"maps"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
)

// UnrefMatching drops exactly the references its predicate matches, keeps a
// file another holder still references, and frees it with its last one.
func TestUnrefMatching(t *testing.T) {
	root, s, pf := storeWithFile(t)
	if err := pf.Publish("snapshot:/nowhere"); err != nil { // a dead holder
		t.Fatal(err)
	}
	file := pf.Name()
	for _, h := range []string{"container:ns/a", "patches:ns/a/x.mem", "patches:ns/a/y.mem", "container:ns/b", "patches:ns/ab/z.mem"} {
		if err := s.Ref("fam", h, []string{file}); err != nil {
			t.Fatal(err)
		}
	}
	ofA := func(h string) bool { return h == "container:ns/a" || strings.HasPrefix(h, "patches:ns/a/") }
	if err := s.UnrefMatching("fam", ofA); err != nil {
		t.Fatal(err)
	}
	h, err := s.Holders("fam")
	if err != nil {
		t.Fatal(err)
	}
	left := slices.Sorted(maps.Keys(h))
	if !slices.Equal(left, []string{"container:ns/b", "patches:ns/ab/z.mem"}) {
		t.Errorf("holders after dropping a's: %v, want b's and ab's", left)
	}
	path := filepath.Join(root, "fam", file)
	if _, err := os.Stat(path); err != nil {
		t.Fatalf("a file b still references was freed: %v", err)
	}
	if err := s.UnrefMatching("fam", func(string) bool { return true }); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(path); !os.IsNotExist(err) {
		t.Errorf("the file outlived its last reference: %v", err)
	}
}
