package main

import (
	"context"
	"fmt"
	"io"
	"sort"
	"time"

	containerd "github.com/containerd/containerd/v2/client"

	"github.com/lazyfork/lazyfork/integration/harness"
	"github.com/lazyfork/lazyfork/internal/cgroupmem"
	"github.com/lazyfork/lazyfork/internal/procfs"
)

// statsFlush is how long the kernel may take to bring a cgroup's page
// statistics (memory.stat) up to date with its charges: its periodic flush
// runs every 2 s.
const statsFlush = 2500 * time.Millisecond

// forkMem is one fork's cgroup memory: its usage and what memory.stat says
// it is made of (cgroup v1 keys, or v2's), and on v1 the kernel memory
// charged to it (memory.kmem.usage_in_bytes; -1 where there is none).
type forkMem struct {
	id    string
	usage int64
	stat  map[string]int64
	kmem  int64
}

// user is the memory of the fork's own pages: v1 rss + cache, v2 anon + file.
func (f forkMem) user() int64 {
	if _, ok := f.stat["anon"]; ok {
		return f.stat["anon"] + f.stat["file"]
	}
	return f.stat["rss"] + f.stat["cache"]
}

// kernel is the kernel memory charged to the cgroup: page tables, kernel
// stacks, slab objects (task, files, mounts, namespaces), sockets (v2
// memory.stat's kernel and sock, v1's memory.kmem.usage_in_bytes; where
// neither is known, the usage less the user pages).
func (f forkMem) kernel() int64 {
	if k, ok := f.stat["kernel"]; ok {
		return k + f.stat["sock"]
	}
	if f.kmem >= 0 {
		return f.kmem
	}
	return f.usage - f.user()
}

// held is the memory the fork holds: its pages and the kernel's objects.
func (f forkMem) held() int64 { return f.user() + f.kernel() }

// precharge is the rest of the usage: pages charged to the cgroup ahead of
// need and not allocated. The kernel charges a cgroup 64 pages at a time and
// keeps what the allocation did not use as a per-CPU stock for the cgroup
// last charged on that CPU (a few cgroups per CPU), so whichever forks
// charged last when the usage is read show up to 256 KB a CPU more than
// they hold; it returns to the machine when the stock is drained. The
// page statistics lag the charges by up to 2 s (the kernel flushes them
// periodically): read a second time after that to tell the two apart.
func (f forkMem) precharge() int64 { return f.usage - f.held() }

func (f forkMem) String() string {
	s := fmt.Sprintf("%s: %.3f MB = user %.3f MB", f.id, mb(f.usage), mb(f.user()))
	for _, k := range []string{"rss", "cache", "shmem", "mapped_file", "anon", "file"} {
		if v, ok := f.stat[k]; ok && v > 0 {
			s += fmt.Sprintf(" (%s %.3f)", k, mb(v))
		}
	}
	s += fmt.Sprintf(" + kernel %.3f MB", mb(f.kernel()))
	for _, k := range []string{"kernel_stack", "pagetables", "slab", "sock", "percpu"} {
		if v, ok := f.stat[k]; ok && v > 0 {
			s += fmt.Sprintf(" (%s %.3f)", k, mb(v))
		}
	}
	return s + fmt.Sprintf(" + charged ahead %.3f MB", mb(f.precharge()))
}

func mb(v int64) float64 { return float64(v) / 1e6 }

// forkMems reads the forks' cgroups.
func (b *bench) forkMems(ctx context.Context, ctrs []containerd.Container) []forkMem {
	var out []forkMem
	for _, c := range ctrs {
		spec, err := c.Spec(b.h.Context(ctx))
		if err != nil {
			continue
		}
		u, err := cgroupmem.Usage(spec.Linux.CgroupsPath)
		if err != nil {
			continue
		}
		st, _ := cgroupmem.Stat(spec.Linux.CgroupsPath)
		out = append(out, forkMem{id: c.ID(), usage: u, stat: st, kmem: kmemV1(spec.Linux.CgroupsPath)})
	}
	return out
}

// printComposition prints what the forks' memory is made of (the smallest,
// the median and the largest few, each split as memory.stat splits it), and
// each shim's: its tasks (children), PSS split into anonymous (Go's heap,
// stacks and runtime) and file-backed (the binary's text, shared between
// shims), and RSS.
func printComposition(w io.Writer, fms []forkMem, address string) {
	if len(fms) > 0 {
		sort.Slice(fms, func(i, j int) bool { return fms[i].usage < fms[j].usage })
		var user, kern, pre int64
		for _, f := range fms {
			user += f.user()
			kern += f.kernel()
			pre += f.precharge()
		}
		n := int64(len(fms))
		fmt.Fprintf(w, "  forks' memory, mean: user %.3f MB + kernel %.3f MB + charged ahead %.3f MB\n", mb(user/n), mb(kern/n), mb(pre/n))
		show := []int{0, len(fms) / 2}
		for i := max(len(fms)-3, len(fms)/2+1); i < len(fms); i++ {
			show = append(show, i)
		}
		for _, i := range show {
			fmt.Fprintf(w, "  fork #%d of %d by memory, %s\n", i+1, len(fms), fms[i])
		}
	}
	for _, pid := range harness.ShimPIDs(address) {
		m, err := procfs.ReadMem(pid)
		if err != nil {
			continue
		}
		kids, _ := procfs.Children(pid)
		fmt.Fprintf(w, "  shim %d: %d tasks, PSS %.2f MB (anon %.2f, file/shmem %.2f), RSS %.2f MB (anon %.2f, file %.2f)\n",
			pid, len(kids), mb(m.Pss), mb(m.PssAnon), mb(m.Pss-m.PssAnon), mb(m.RSS), mb(m.RssAnon), mb(m.RssFile))
	}
}

// kmemV1 is the kernel memory charged to cgroup p on a v1 memory hierarchy
// (memory.kmem.usage_in_bytes), -1 where there is none.
func kmemV1(p string) int64 {
	if v, ok := cgroupmem.KmemV1(p); ok {
		return v
	}
	return -1
}
