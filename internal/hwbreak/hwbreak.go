package hwbreak

import (
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

// CRIUEnv returns env (KEY=value pairs) with CRIU_FAULT=130 added when
// breakpoints do not work here and env sets no CRIU_FAULT of its own.
func CRIUEnv(env []string) []string {
	if ok, _ := Work(); ok {
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
// CRIU it starts, through runc or directly) when breakpoints do not work and
// nothing set CRIU_FAULT already. It reports whether it set it.
func SetCRIUEnv() (bool, error) {
	ok, err := Work()
	if ok || os.Getenv(CRIUFault) != "" {
		return false, err
	}
	return true, os.Setenv(CRIUFault, NoBreakpoints)
}
