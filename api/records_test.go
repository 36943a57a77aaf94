package api

import (
	"encoding/json"
	"path/filepath"
	"strings"
	"testing"
)

// Records written by earlier versions keep reading: the JSON keys are the
// contract, not the Go names.
func TestRecordsReadTheirWrittenForm(t *testing.T) {
	var si SnapshotInfo
	if err := json.Unmarshal([]byte(`{"family":"f1","files":["a.mem"],"pages":3,"kept_pages":1,"map_dir":"/.lazyfork/mem"}`), &si); err != nil {
		t.Fatal(err)
	}
	if si.Family != "f1" || len(si.Files) != 1 || si.Pages != 3 || si.KeptPages != 1 || si.MapDir != "/.lazyfork/mem" {
		t.Fatalf("snapshot info read as %+v", si)
	}
	var rr RootfsRecord
	if err := json.Unmarshal([]byte(`{"frozen":"fz","snapshotter":"lazyfork","namespace":"default"}`), &rr); err != nil || rr.Frozen != "fz" || rr.Snapshotter != "lazyfork" {
		t.Fatalf("rootfs record read as %+v (%v)", rr, err)
	}
	var src SnapshotSource
	if err := json.Unmarshal([]byte(`{"namespace":"ns","container":"c","family":"f","forkable":true,"taken":"2026-01-01T00:00:00Z"}`), &src); err != nil || src.Container != "c" || !src.Forkable || !src.Thawed.IsZero() {
		t.Fatalf("source read as %+v (%v)", src, err)
	}
	if b, _ := json.Marshal(&src); strings.Contains(string(b), "thawed") {
		t.Fatalf("an unthawed source records a thaw: %s", b)
	}
}

func TestRootLayout(t *testing.T) {
	r := Root("/run/lazyfork")
	for got, want := range map[string]string{
		r.Mem(): "/run/lazyfork/mem", r.Snapshots(): "/run/lazyfork/snapshots", r.Ops(): "/run/lazyfork/ops",
		r.Locks(): "/run/lazyfork/locks", r.Logs(): "/run/lazyfork/logs", r.FamilyRecord("f"): "/run/lazyfork/families/f.json",
		ImageDir(filepath.Join(r.Snapshots(), "s")): "/run/lazyfork/snapshots/s/image",
	} {
		if got != want {
			t.Errorf("got %s, want %s", got, want)
		}
	}
}

func TestValidName(t *testing.T) {
	long := strings.Repeat("a", 128)
	for s, want := range map[string]bool{
		"a": true, "family-1.2_x": true, "0abc": true, long: true,
		"": false, long + "a": false, "-a": false, ".a": false, "_a": false,
		"a/b": false, "a b": false, "..": false, "a\x00": false, "é": false,
	} {
		if got := ValidName(s); got != want {
			t.Errorf("ValidName(%q) = %v, want %v", s, got, want)
		}
	}
}
