package memfile

import (
	"slices"
	"testing"
)

// joinClosest joins the smallest gaps first, never across a reused patch,
// and leaves spans within the limit alone.
func TestJoinClosest(t *testing.T) {
	spans := func() [][2]uint64 {
		return [][2]uint64{{0, 1}, {10, 11}, {12, 13}, {30, 31}, {33, 34}, {100, 101}}
	}
	if got := joinClosest(spans(), nil, 6); !slices.Equal(got, spans()) {
		t.Errorf("within the limit: %v", got)
	}
	// Gaps 9, 1, 17, 2, 66: the 1 and the 2 go first.
	if got, want := joinClosest(spans(), nil, 4), [][2]uint64{{0, 1}, {10, 13}, {30, 34}, {100, 101}}; !slices.Equal(got, want) {
		t.Errorf("limit 4: %v, want %v", got, want)
	}
	// A reused patch in the gap of 1 bars it: the 2 and the 9 go instead.
	reused := []piece{{start: 11, end: 12}}
	if got, want := joinClosest(spans(), reused, 4), [][2]uint64{{0, 11}, {12, 13}, {30, 34}, {100, 101}}; !slices.Equal(got, want) {
		t.Errorf("limit 4, reused at 11: %v, want %v", got, want)
	}
	// Every gap barred: left as they are.
	all := []piece{{start: 1, end: 2}, {start: 11, end: 12}, {start: 13, end: 14}, {start: 31, end: 32}, {start: 34, end: 35}}
	if got := joinClosest(spans(), all, 2); len(got) != 6 {
		t.Errorf("every gap barred: %v", got)
	}
}
