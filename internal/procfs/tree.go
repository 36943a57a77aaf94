package procfs

import (
	"bufio"
	"fmt"
	"os"
	"slices"
	"sort"
	"strconv"
	"strings"

	"github.com/containerd/errdefs"
)

// Children returns the child processes of pid (of all its threads), sorted.
func Children(pid int) ([]int, error) {
	tasks, err := os.ReadDir("/proc/" + strconv.Itoa(pid) + "/task")
	if err != nil {
		return nil, fmt.Errorf("process %d: %w", pid, errdefs.ErrNotFound)
	}
	var kids []int
	for _, t := range tasks {
		b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/task/" + t.Name() + "/children")
		if err != nil {
			continue
		}
		for _, f := range strings.Fields(string(b)) {
			if k, err := strconv.Atoi(f); err == nil {
				kids = append(kids, k)
			}
		}
	}
	sort.Ints(kids)
	return kids, nil
}

// Tree returns pid and all its descendant processes (not threads), parents
// first. A missing pid is an error wrapping errdefs.ErrNotFound; descendants
// that exit while being listed are skipped.
func Tree(pid int) ([]int, error) {
	if _, err := ReadStat(pid); err != nil {
		return nil, err
	}
	out := []int{pid}
	for i := 0; i < len(out); i++ {
		kids, _ := Children(out[i])
		out = append(out, kids...)
	}
	return out, nil
}

// NSPID returns pid as seen inside its own (innermost) PID namespace.
func NSPID(pid int) (int, error) {
	b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/status")
	if err != nil {
		return 0, fmt.Errorf("process %d: %w", pid, errdefs.ErrNotFound)
	}
	for _, l := range strings.Split(string(b), "\n") {
		if f, ok := strings.CutPrefix(l, "NSpid:"); ok {
			fs := strings.Fields(f)
			if len(fs) == 0 {
				break
			}
			return strconv.Atoi(fs[len(fs)-1])
		}
	}
	return 0, fmt.Errorf("process %d: no NSpid in status: %w", pid, errdefs.ErrNotImplemented)
}

// IsPIDNSInit reports whether pid is PID 1 of a PID namespace other than the
// caller's.
func IsPIDNSInit(pid int) (bool, error) {
	mine, err := os.Readlink("/proc/self/ns/pid")
	if err != nil {
		return false, err
	}
	theirs, err := os.Readlink("/proc/" + strconv.Itoa(pid) + "/ns/pid")
	if err != nil {
		return false, fmt.Errorf("process %d: %w", pid, err)
	}
	if mine == theirs {
		return false, nil
	}
	nspid, err := NSPID(pid)
	if err != nil {
		return false, err
	}
	return nspid == 1, nil
}

// Mem is the memory of a process or a tree, in bytes.
type Mem struct {
	RSS      int64 // VmRSS: every resident page
	RssAnon  int64 // private anonymous pages: what a copy costs on its own
	RssFile  int64
	RssShmem int64 // shared-memory and tmpfs pages, memory files included
	Pss      int64 // proportional share of everything mapped
	PssAnon  int64
	PssShmem int64
}

// Add returns m + o.
func (m Mem) Add(o Mem) Mem {
	return Mem{m.RSS + o.RSS, m.RssAnon + o.RssAnon, m.RssFile + o.RssFile, m.RssShmem + o.RssShmem,
		m.Pss + o.Pss, m.PssAnon + o.PssAnon, m.PssShmem + o.PssShmem}
}

// ReadMem reads one process's memory from /proc/PID/status and
// smaps_rollup. A missing process is an error wrapping errdefs.ErrNotFound;
// when only smaps_rollup cannot be read (another user's process), the
// status fields are returned with the error.
func ReadMem(pid int) (Mem, error) {
	var m Mem
	dir := "/proc/" + strconv.Itoa(pid)
	err := scanKB(dir+"/status", map[string]*int64{
		"VmRSS:": &m.RSS, "RssAnon:": &m.RssAnon, "RssFile:": &m.RssFile, "RssShmem:": &m.RssShmem,
	})
	if err != nil {
		return m, err
	}
	err = scanKB(dir+"/smaps_rollup", map[string]*int64{
		"Pss:": &m.Pss, "Pss_Anon:": &m.PssAnon, "Pss_Shmem:": &m.PssShmem,
	})
	return m, err
}

// TreeMem sums ReadMem over pid and its descendants. Processes that exit
// while being read are skipped.
func TreeMem(pid int) (Mem, error) {
	pids, err := Tree(pid)
	if err != nil {
		return Mem{}, err
	}
	var total Mem
	for i, p := range pids {
		m, err := ReadMem(p)
		if err != nil {
			if i == 0 {
				return Mem{}, err
			}
			continue
		}
		total = total.Add(m)
	}
	return total, nil
}

// Status returns the value of one field of /proc/PID/status ("" if absent).
func Status(pid int, field string) (string, error) {
	b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/status")
	if err != nil {
		return "", fmt.Errorf("process %d: %w", pid, errdefs.ErrNotFound)
	}
	for _, l := range strings.Split(string(b), "\n") {
		if v, ok := strings.CutPrefix(l, field+":"); ok {
			return strings.TrimSpace(v), nil
		}
	}
	return "", nil
}

func scanKB(path string, want map[string]*int64) error {
	f, err := os.Open(path)
	if err != nil {
		return fmt.Errorf("%s: %w", path, errdefs.ErrNotFound)
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		fs := strings.Fields(sc.Text())
		if len(fs) < 2 {
			continue
		}
		if p, ok := want[fs[0]]; ok {
			v, err := strconv.ParseInt(fs[1], 10, 64)
			if err != nil {
				return fmt.Errorf("%s: %q: %w", path, sc.Text(), errdefs.ErrDataLoss)
			}
			*p = v * 1024
		}
	}
	return sc.Err()
}

// Process is a process found by Find: its PID and its argv.
type Process struct {
	PID  int
	Args []string
}

// Find lists the processes whose argv match (all processes for a nil match),
// in /proc's order. Processes that exit while being read are skipped.
func Find(match func(args []string) bool) []Process {
	ents, err := os.ReadDir("/proc")
	if err != nil {
		return nil
	}
	var out []Process
	for _, e := range ents {
		pid, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		b, err := os.ReadFile("/proc/" + e.Name() + "/cmdline")
		if err != nil {
			continue
		}
		args := strings.Split(strings.TrimRight(string(b), "\x00"), "\x00")
		if match == nil || match(args) {
			out = append(out, Process{PID: pid, Args: args})
		}
	}
	return out
}

// HasArg reports whether args hold one of flags immediately followed by value.
func HasArg(args []string, value string, flags ...string) bool {
	for i := 0; i+1 < len(args); i++ {
		if args[i+1] == value && slices.Contains(flags, args[i]) {
			return true
		}
	}
	return false
}

// MemInfo returns a field of /proc/meminfo ("MemTotal", "MemAvailable"...)
// in bytes. A missing field is an error wrapping errdefs.ErrNotFound.
func MemInfo(field string) (int64, error) {
	var v int64 = -1
	if err := scanKB("/proc/meminfo", map[string]*int64{field + ":": &v}); err != nil {
		return 0, err
	}
	if v < 0 {
		return 0, fmt.Errorf("no %s in /proc/meminfo: %w", field, errdefs.ErrNotFound)
	}
	return v, nil
}
