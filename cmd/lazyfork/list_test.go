package main

import (
	"testing"
)

func TestMemFileCell(t *testing.T) {
	for _, c := range []struct {
		r    row
		want string
	}{
		{row{PID: 42, MemFile: true, MemFileBytes: 64 << 20, MemFileMappings: 3}, "yes 64.0 MiB"},
		{row{PID: 42}, "no"},
		{row{}, "-"},
	} {
		if got := c.r.memFileCell(); got != c.want {
			t.Errorf("%+v: %q, want %q", c.r, got, c.want)
		}
	}
}
