package main

import (
	"bytes"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// TestReport: the lazyfork handler failing a spec runc passes fails the run;
// failing what runc fails too does not.
func TestReport(t *testing.T) {
	h := []string{"runc", "lazyfork"}
	same := map[string]map[string]string{
		"runc":     {"a": "passed", "b": "failed", "c": "skipped"},
		"lazyfork": {"a": "passed", "b": "failed", "c": "skipped"},
	}
	var out bytes.Buffer
	if code := report(&out, h, same); code != 0 {
		t.Errorf("same results: exit %d\n%s", code, &out)
	}
	if !strings.Contains(out.String(), "1/1/1 1/1/1") || strings.Contains(out.String(), " a\n") {
		t.Errorf("report:\n%s", &out)
	}
	worse := map[string]map[string]string{
		"runc":     {"a": "passed"},
		"lazyfork": {"a": "failed"},
	}
	out.Reset()
	if code := report(&out, h, worse); code != 1 {
		t.Errorf("lazyfork fails what runc passes: exit %d\n%s", code, &out)
	}
}

func TestReadJUnit(t *testing.T) {
	p := filepath.Join(t.TempDir(), "r.xml")
	x := `<testsuites><testsuite name="CRI">
<testcase name="[BeforeSuite]" status="passed"></testcase>
<testcase name="[It] a" status="passed"></testcase>
<testcase name="[It] b" status="failed"><failure/></testcase>
<testcase name="[It] c" status="skipped"><skipped/></testcase>
<testcase name="[It] d" status="timedout"></testcase>
</testsuite></testsuites>`
	if err := os.WriteFile(p, []byte(x), 0o644); err != nil {
		t.Fatal(err)
	}
	res, err := readJUnit(p)
	if err != nil {
		t.Fatal(err)
	}
	want := map[string]string{"a": "passed", "b": "failed", "c": "skipped", "d": "failed"}
	if len(res) != len(want) {
		t.Errorf("specs %v, want %v", res, want)
	}
	for k, v := range want {
		if res[k] != v {
			t.Errorf("%s: %q, want %q", k, res[k], v)
		}
	}
}
