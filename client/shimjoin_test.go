package client

import (
	"reflect"
	"testing"
)

// TestFillGroups: a call's groups fill the fullest family groups that hold
// all of their forks, each group once; the rest start shims of their own.
func TestFillGroups(t *testing.T) {
	forks := func(n int) []string { return make([]string, n) }
	groups := []familyGroup{{name: "a", members: forks(3)}, {name: "b", members: forks(49)}, {name: "c", members: forks(10)}, {name: "d", members: forks(50)}}
	for _, tc := range []struct {
		name  string
		sizes []int
		size  int
		want  []string // "" is a new shim
	}{
		{"one fork fills the fullest with room", []int{1}, 50, []string{"b"}},
		{"a group that does not fit whole goes elsewhere", []int{2}, 50, []string{"c"}},
		{"each family group at most once", []int{1, 1, 1, 1}, 50, []string{"b", "c", "a", ""}},
		{"too big for any", []int{48}, 50, []string{""}},
		{"a call's last, smaller group", []int{50, 40}, 50, []string{"", "c"}},
		{"group size 1: a shim each", []int{1, 1}, 1, []string{"", ""}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var got []string
			for _, g := range fillGroups(tc.sizes, tc.size, groups) {
				if g == nil {
					got = append(got, "")
				} else {
					got = append(got, g.name)
				}
			}
			if !reflect.DeepEqual(got, tc.want) {
				t.Errorf("fillGroups(%v, %d) = %q, want %q", tc.sizes, tc.size, got, tc.want)
			}
		})
	}
	if got := fillGroups([]int{1}, 50, nil); len(got) != 1 || got[0] != nil {
		t.Errorf("no family groups: %v, want a new shim", got)
	}
}

// TestFreshGroupName: a new group never takes a name the family's forks
// carry (a full group of a kept snapshot restored again), nor one it gave.
func TestFreshGroupName(t *testing.T) {
	taken := map[string]bool{"f-s-0": true, "f-s-0-2": true}
	for _, want := range []string{"f-s-0-3", "f-s-0-4"} {
		if got := freshGroupName("f-s-0", taken); got != want {
			t.Errorf("freshGroupName = %q, want %q", got, want)
		}
	}
	if got := freshGroupName("f-s-1", taken); got != "f-s-1" {
		t.Errorf("an unused base: %q, want it as is", got)
	}
}
