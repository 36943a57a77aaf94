package hwbreak

import (
	"errors"
	"os"
	"strings"
	"sync"
)

// CRIUFault is CRIU's environment variable for fault injection; NoBreakpoints
// is its FI_NO_BREAKPOINTS code.
const (
	CRIUFault     = "CRIU_FAULT"
	NoBreakpoints = "130"
)

var probed = sync.OnceValues(Probe)

// Work is Probe, once per process.
func Work() (bool, error) { return probed() }

// trusted reports whether CRIU may use breakpoints: only where the probe saw
// one trap. A probe that failed counts as "no": a few more ptrace stops
// rather than a hang.
func trusted() bool {
	ok, err := Work()
	return ok && err == nil
}

// CRIUEnv returns env (KEY=value pairs) with CRIU_FAULT=130 added when
// breakpoints are not known to work here and env sets no CRIU_FAULT of its
// own.
func CRIUEnv(env []string) []string {
	if trusted() {
		return env
	}
	for _, kv := range env {
		if strings.HasPrefix(kv, CRIUFault+"=") {
			return env
		}
	}
	return append(env, CRIUFault+"="+NoBreakpoints)
}

// SetCRIUEnv sets CRIU_FAULT=130 in this process's environment (for every
// CRIU it starts, through runc or directly) when breakpoints are not known
// to work and nothing set CRIU_FAULT already. It reports whether it set it,
// and why the probe failed if it did.
func SetCRIUEnv() (bool, error) {
	_, err := Work()
	if trusted() || os.Getenv(CRIUFault) != "" {
		return false, err
	}
	return true, errors.Join(err, os.Setenv(CRIUFault, NoBreakpoints))
}
