package ctrbench

import (
	"fmt"
	"os"
	"strconv"
	"strings"

	"github.com/lazyfork/lazyfork/integration/harness"
)

// ProcMemory is a process's resident memory, in bytes.
type ProcMemory struct {
	RSS     int64 // VmRSS (/proc/PID/status)
	RssAnon int64 // private anonymous pages: the process's own cost
	Pss     int64 // proportional set size (/proc/PID/smaps_rollup): shared pages split among their users
}

// ReadProcMemory reads VmRSS, RssAnon and Pss of pid.
func ReadProcMemory(pid int) (ProcMemory, error) {
	var m ProcMemory
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		return m, err
	}
	if r, err := os.ReadFile(fmt.Sprintf("/proc/%d/smaps_rollup", pid)); err == nil {
		b = append(append(b, '\n'), r...)
	}
	for _, l := range strings.Split(string(b), "\n") {
		f := strings.Fields(l)
		if len(f) < 2 {
			continue
		}
		kb, err := strconv.ParseInt(f[1], 10, 64)
		if err != nil {
			continue
		}
		switch f[0] {
		case "VmRSS:":
			m.RSS = kb << 10
		case "RssAnon:":
			m.RssAnon = kb << 10
		case "Pss:":
			m.Pss = kb << 10
		}
	}
	return m, nil
}

// ShimMemory sums the memory of every shim process serving e's containerd and
// returns how many there are: the per-container overhead outside the cgroups.
func (e *Env) ShimMemory() (n int, total ProcMemory, err error) {
	for _, pid := range harness.ShimPIDs(e.H.Address) {
		m, err := ReadProcMemory(pid)
		if err != nil {
			continue // exited meanwhile
		}
		n++
		total.RSS += m.RSS
		total.RssAnon += m.RssAnon
		total.Pss += m.Pss
	}
	return n, total, nil
}
