package ctrbench

import (
	"github.com/lazyfork/lazyfork/integration/harness"
	"github.com/lazyfork/lazyfork/internal/procfs"
)

// ProcMemory is a process's resident memory, in bytes (RSS, RssAnon and
// Pss are the fields the benchmarks report).
type ProcMemory = procfs.Mem

// ReadProcMemory reads the memory of pid.
func ReadProcMemory(pid int) (ProcMemory, error) { return procfs.ReadMem(pid) }

// ShimMemory sums the memory of every shim process serving e's containerd and
// returns how many there are: the per-container overhead outside the cgroups.
func (e *Env) ShimMemory() (n int, total ProcMemory, err error) {
	for _, pid := range harness.ShimPIDs(e.H.Address) {
		m, err := ReadProcMemory(pid)
		if err != nil {
			continue // exited meanwhile
		}
		n++
		total = total.Add(m)
	}
	return n, total, nil
}
