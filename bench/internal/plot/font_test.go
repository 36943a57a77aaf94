package plot

import (
	"strings"
	"testing"
)

func TestGlyphsWellFormed(t *testing.T) {
	for r, rows := range glyphRows {
		f := strings.Fields(rows)
		if len(f) != 5 {
			t.Errorf("%q: %d rows", r, len(f))
		}
		for _, row := range f {
			if len(row) != 3 || strings.Trim(row, "#.") != "" {
				t.Errorf("%q: bad row %q", r, row)
			}
		}
	}
}
