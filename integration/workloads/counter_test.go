package workloads

import "testing"

func TestParseTick(t *testing.T) {
	for _, c := range []struct {
		line string
		n    int
		ok   bool
	}{{"tick 1", 1, true}, {"tick 4711", 4711, true}, {"tick", 0, false}, {"tick x", 0, false}, {"verify ok pages=1 writes=0", 0, false}} {
		n, ok := ParseTick(c.line)
		if n != c.n || ok != c.ok {
			t.Errorf("ParseTick(%q) = %d, %v; want %d, %v", c.line, n, ok, c.n, c.ok)
		}
	}
}
