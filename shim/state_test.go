package shim

import (
	"os"
	"path/filepath"
	"testing"

	"github.com/lazyfork/lazyfork/api"
)

// The bundle's state has a name of its own (not a snapshot's lazyfork.json),
// and a bundle an earlier shim wrote is still read.
func TestStateFileName(t *testing.T) {
	dir := t.TempDir()
	if err := writeState(dir, &containerState{ID: "c1", Family: "f"}); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(filepath.Join(dir, api.BundleStateFile)); err != nil {
		t.Fatalf("state not at %s: %v", api.BundleStateFile, err)
	}
	legacy := t.TempDir()
	if err := os.WriteFile(filepath.Join(legacy, legacyStateFile), []byte(`{"id":"c2","family":"g"}`), 0o600); err != nil {
		t.Fatal(err)
	}
	st, err := readState(legacy)
	if err != nil || st == nil || st.ID != "c2" || st.Family != "g" {
		t.Fatalf("legacy state read as %+v, %v", st, err)
	}
}
