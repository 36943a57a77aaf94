package main

import (
	"bufio"
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"sort"
	"strconv"
	"strings"
)

// Breakdown (-breakdown): where a call's pause and a fork's memory go, for
// the measurements of issue 11. Per call it prints the shim's phase fields of
// the move and of the checkpoint, and, for the call's fork, its memory as the
// kernel accounts it.

var logField = regexp.MustCompile(`\b(seize|plan|copy_map|map|map_batched|consolidation|consolidation_check|guard|helper_run|join|writes|vmas|move|dump|until_thaw|wipe_read|duration|pages_kept|pages_moved|rebased|replaced_ranges|precopied|precopied_vmas|frozen|protect)=("[^"]*"|\S+)`)

// phases is the shim's account of the last move and checkpoint of id.
func (b *bench) phases(id string) string {
	var moved, ckpt, pre string
	for _, l := range strings.Split(b.h.Log(), "\n") {
		if !strings.Contains(l, "id="+id+" ") {
			continue
		}
		if strings.Contains(l, "moved onto memory file") {
			moved = l
		}
		if strings.Contains(l, "checkpoint rewritten") {
			ckpt = l
		}
		if strings.Contains(l, "lazyfork: precopy") {
			pre = l
		}
	}
	f := func(l string) string {
		var out []string
		for _, m := range logField.FindAllStringSubmatch(l, -1) {
			out = append(out, m[1]+"="+strings.Trim(m[2], `"`))
		}
		return strings.Join(out, " ")
	}
	return "precopy[" + f(pre) + "] move[" + f(moved) + "] checkpoint[" + f(ckpt) + "]"
}

// memBreakdown is one process's memory and its memory cgroup's (cgroup v1).
func memBreakdown(cgroupsPath string, pid int) string {
	var sb strings.Builder
	maps, _ := os.ReadFile(fmt.Sprintf("/proc/%d/maps", pid))
	vmas, files := 0, map[string]bool{}
	for _, l := range strings.Split(string(maps), "\n") {
		fs := strings.Fields(l)
		if len(fs) < 5 {
			continue
		}
		vmas++
		if len(fs) >= 6 && strings.HasPrefix(fs[5], "/") {
			files[fs[5]] = true
		}
	}
	fmt.Fprintf(&sb, "vmas %d (files %d)", vmas, len(files))
	if r, err := os.ReadFile(fmt.Sprintf("/proc/%d/smaps_rollup", pid)); err == nil {
		for _, k := range []string{"Rss", "Pss", "Anonymous", "Private_Dirty", "Shared_Clean"} {
			fmt.Fprintf(&sb, " %s %s", k, kbField(string(r), k))
		}
	}
	if st, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid)); err == nil {
		fmt.Fprintf(&sb, " VmPTE %s", kbField(string(st), "VmPTE"))
	}
	dir := filepath.Join("/sys/fs/cgroup/memory", cgroupsPath)
	if st, err := os.ReadFile(filepath.Join(dir, "memory.stat")); err == nil {
		for _, k := range []string{"rss", "cache", "shmem", "mapped_file"} {
			fmt.Fprintf(&sb, " cg.%s %s", k, statField(string(st), k))
		}
	}
	for _, k := range []string{"memory.usage_in_bytes", "memory.kmem.usage_in_bytes"} {
		if b, err := os.ReadFile(filepath.Join(dir, k)); err == nil {
			n, _ := strconv.ParseInt(strings.TrimSpace(string(b)), 10, 64)
			fmt.Fprintf(&sb, " %s %.1fK", strings.TrimPrefix(k, "memory."), float64(n)/1024)
		}
	}
	if b, err := os.ReadFile(filepath.Join(dir, "memory.kmem.slabinfo")); err == nil {
		type slab struct {
			name  string
			bytes int64
		}
		var ss []slab
		sc := bufio.NewScanner(strings.NewReader(string(b)))
		for sc.Scan() {
			fs := strings.Fields(sc.Text())
			if len(fs) < 4 || strings.HasPrefix(fs[0], "#") || fs[0] == "slabinfo" {
				continue
			}
			act, _ := strconv.ParseInt(fs[1], 10, 64)
			sz, _ := strconv.ParseInt(fs[3], 10, 64)
			if act*sz > 0 {
				ss = append(ss, slab{fs[0], act * sz})
			}
		}
		sort.Slice(ss, func(i, j int) bool { return ss[i].bytes > ss[j].bytes })
		sb.WriteString(" slabs:")
		for i, s := range ss {
			if i == 8 {
				break
			}
			fmt.Fprintf(&sb, " %s=%.1fK", s.name, float64(s.bytes)/1024)
		}
	}
	return sb.String()
}

func kbField(s, k string) string {
	for _, l := range strings.Split(s, "\n") {
		if rest, ok := strings.CutPrefix(l, k+":"); ok {
			return strings.TrimSpace(strings.TrimSuffix(strings.TrimSpace(rest), "kB")) + "K"
		}
	}
	return "?"
}

func statField(s, k string) string {
	for _, l := range strings.Split(s, "\n") {
		if rest, ok := strings.CutPrefix(l, k+" "); ok {
			n, _ := strconv.ParseInt(strings.TrimSpace(rest), 10, 64)
			return fmt.Sprintf("%.1fK", float64(n)/1024)
		}
	}
	return "?"
}
