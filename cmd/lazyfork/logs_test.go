package main

import (
	"bytes"
	"context"
	"os"
	"path/filepath"
	"testing"

	"github.com/lazyfork/lazyfork/node"
)

// nerdctl's json-file lines become the output again, stdout and stderr
// apart, whatever the chunks the file is read in.
func TestJSONLogWriter(t *testing.T) {
	log := `{"log":"tick 1\n","stream":"stdout","time":"2026-12-01T17:00:00Z"}
{"log":"oops\n","stream":"stderr","time":"2026-12-01T17:00:00Z"}
{"log":"tick 2\n","stream":"stdout","time":"2026-12-01T17:00:01Z"}
`
	for _, chunk := range []int{1, 7, len(log)} {
		var out, errOut bytes.Buffer
		w := &jsonLogWriter{stdout: &out, stderr: &errOut}
		for i := 0; i < len(log); i += chunk {
			end := min(i+chunk, len(log))
			if _, err := w.Write([]byte(log[i:end])); err != nil {
				t.Fatal(err)
			}
		}
		if out.String() != "tick 1\ntick 2\n" || errOut.String() != "oops\n" {
			t.Errorf("chunks of %d: stdout %q, stderr %q", chunk, out.String(), errOut.String())
		}
	}
}

// A follow prints what is there and ends once the writer has ended.
func TestTailFileEnds(t *testing.T) {
	p := filepath.Join(t.TempDir(), "x.log")
	if err := os.WriteFile(p, []byte("one\ntwo\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	var out bytes.Buffer
	if err := tailFile(context.Background(), node.NewLocal(t.TempDir()), p, true, func() bool { return true }, &out); err != nil || out.String() != "one\ntwo\n" {
		t.Errorf("follow of an ended container's log: %q %v", out.String(), err)
	}
	out.Reset()
	if err := tailFile(context.Background(), node.NewLocal(t.TempDir()), p, false, func() bool { return false }, &out); err != nil || out.String() != "one\ntwo\n" {
		t.Errorf("no follow: %q %v", out.String(), err)
	}
	if err := tailFile(context.Background(), node.NewLocal(t.TempDir()), p+".none", true, func() bool { return true }, &out); err == nil {
		t.Error("follow of a log never written by an ended container: no error")
	}
}
