package main

import (
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"testing"
)

// The helper runs inside a container's pause: it links neither containerd,
// gRPC nor ttrpc, nor the memory-file store, whose package initialisation
// makes the shim's binary start in about 7 ms of CPU.
func TestHelperLinksLittle(t *testing.T) {
	gobin := filepath.Join(runtime.GOROOT(), "bin", "go")
	if _, err := os.Stat(gobin); err != nil {
		if gobin, err = exec.LookPath("go"); err != nil {
			t.Skip("no go command to list the helper's dependencies")
		}
	}
	out, err := exec.Command(gobin, "list", "-deps", ".").CombinedOutput()
	if err != nil {
		t.Fatalf("go list: %v\n%s", err, out)
	}
	for _, p := range strings.Fields(string(out)) {
		for _, heavy := range []string{"github.com/containerd/containerd/", "google.golang.org/grpc", "github.com/containerd/ttrpc", "github.com/lazyfork/lazyfork/shim"} {
			if strings.HasPrefix(p, heavy) {
				t.Errorf("lazyfork-rehome links %s", p)
			}
		}
		if p == "github.com/lazyfork/lazyfork/memfile" {
			t.Errorf("lazyfork-rehome links the memory-file store (memfile)")
		}
	}
}
