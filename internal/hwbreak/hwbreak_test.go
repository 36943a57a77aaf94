package hwbreak_test

import (
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/lazyfork/lazyfork/internal/hwbreak"
	"github.com/lazyfork/lazyfork/internal/testutil"
)

// The probe agrees with CRIU: where it finds breakpoints broken, a CRIU dump
// left to use them never finishes, and one with CRIU_FAULT=130 does; where it
// finds them working, a plain dump finishes.
func TestProbeAgreesWithCRIU(t *testing.T) {
	testutil.RequiresRoot(t)
	criu := testutil.RequiresCRIU(t)
	ok, err := hwbreak.Work()
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("hardware breakpoints work: %v", ok)
	dump := func(env []string) error {
		t.Helper()
		sleeper := exec.Command("setsid", "sleep", "1000")
		if err := sleeper.Start(); err != nil {
			t.Fatal(err)
		}
		defer func() { sleeper.Process.Kill(); sleeper.Wait() }()
		time.Sleep(100 * time.Millisecond)
		dir := t.TempDir()
		cmd := exec.Command(criu, "dump", "-t", strconv.Itoa(sleeper.Process.Pid), "-D", dir, "--leave-running", "-o", "dump.log")
		cmd.Env = env
		if err := cmd.Start(); err != nil {
			t.Fatal(err)
		}
		done := make(chan error, 1)
		go func() { done <- cmd.Wait() }()
		select {
		case err := <-done:
			if err != nil {
				b, _ := os.ReadFile(filepath.Join(dir, "dump.log"))
				t.Fatalf("criu dump: %v: %s", err, b)
			}
			return nil
		case <-time.After(5 * time.Second):
			cmd.Process.Kill()
			<-done
			return os.ErrDeadlineExceeded
		}
	}
	var clean []string
	for _, kv := range os.Environ() {
		if !strings.HasPrefix(kv, hwbreak.CRIUFault+"=") {
			clean = append(clean, kv)
		}
	}
	if err := dump(hwbreak.CRIUEnv(clean)); err != nil {
		t.Fatalf("a dump with the environment CRIUEnv gives did not finish in 5 s: %v", err)
	}
	if !ok {
		if err := dump(clean); err == nil {
			t.Error("the probe found breakpoints broken, yet CRIU's dump with them finished")
		}
		if got := hwbreak.CRIUEnv(clean); got[len(got)-1] != hwbreak.CRIUFault+"="+hwbreak.NoBreakpoints {
			t.Errorf("CRIUEnv did not add %s=%s", hwbreak.CRIUFault, hwbreak.NoBreakpoints)
		}
	}
	if got := hwbreak.CRIUEnv([]string{hwbreak.CRIUFault + "=1"}); len(got) != 1 {
		t.Errorf("CRIUEnv overrode a CRIU_FAULT of the caller's: %q", got)
	}
}
