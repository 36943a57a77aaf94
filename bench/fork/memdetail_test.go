package main

import "testing"

// A fork's usage splits into the pages it holds, the kernel's objects and
// what the kernel charged ahead (its per-CPU stock): v1 from memory.stat and
// memory.kmem.usage_in_bytes, v2 from memory.stat's anon, file, kernel, sock.
func TestForkMemSplit(t *testing.T) {
	for _, c := range []struct {
		name                          string
		f                             forkMem
		user, kernel, held, precharge int64
	}{
		{"v1, a stock of 62 pages", forkMem{usage: 1040384, kmem: 335872,
			stat: map[string]int64{"rss": 456704, "cache": 8192, "shmem": 0}},
			464896, 335872, 800768, 239616},
		{"v1, no stock", forkMem{usage: 782336, kmem: 335872,
			stat: map[string]int64{"rss": 438272, "cache": 8192}},
			446464, 335872, 782336, 0},
		{"v1 without kmem accounting", forkMem{usage: 782336, kmem: -1,
			stat: map[string]int64{"rss": 438272, "cache": 8192}},
			446464, 335872, 782336, 0},
		{"v2", forkMem{usage: 1048576, kmem: -1,
			stat: map[string]int64{"anon": 458752, "file": 8192, "kernel": 319488, "sock": 4096}},
			466944, 323584, 790528, 258048},
	} {
		f := c.f
		if f.user() != c.user || f.kernel() != c.kernel || f.held() != c.held || f.precharge() != c.precharge {
			t.Errorf("%s: user %d kernel %d held %d precharge %d, want %d %d %d %d", c.name,
				f.user(), f.kernel(), f.held(), f.precharge(), c.user, c.kernel, c.held, c.precharge)
		}
	}
}
