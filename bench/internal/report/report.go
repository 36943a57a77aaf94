// Package report prints benchmark tables and writes their CSV files.
//
// A Table has named columns and string cells; Print aligns it for a terminal and
// WriteCSV writes it atomically (temp file + rename) so a killed benchmark never
// leaves half a results file. Benchmarks that put several systems side by side in
// one run use a long format, one measurement per row (see Measurements).
package report

import (
	"encoding/csv"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/lazyfork/lazyfork/internal/atomicfile"
)

// Table is a titled grid of cells.
type Table struct {
	Title   string
	Columns []string
	Rows    [][]string
}

// Add appends a row; values are formatted with Cell.
func (t *Table) Add(values ...any) {
	row := make([]string, len(values))
	for i, v := range values {
		row[i] = Cell(v)
	}
	t.Rows = append(t.Rows, row)
}

// Cell formats a value for a table: durations in seconds (3 decimals), floats
// with 3 significant decimals, the rest with %v.
func Cell(v any) string {
	switch x := v.(type) {
	case string:
		return x
	case time.Duration:
		return strconv.FormatFloat(x.Seconds(), 'f', 3, 64)
	case float64:
		return strconv.FormatFloat(x, 'f', 3, 64)
	default:
		return fmt.Sprint(v)
	}
}

// Print writes the table with aligned columns.
func (t *Table) Print(w io.Writer) {
	widths := make([]int, len(t.Columns))
	for i, c := range t.Columns {
		widths[i] = len(c)
	}
	for _, r := range t.Rows {
		for i, c := range r {
			if i < len(widths) && len(c) > widths[i] {
				widths[i] = len(c)
			}
		}
	}
	line := func(cells []string) {
		var b strings.Builder
		for i, c := range cells {
			if i > 0 {
				b.WriteString("  ")
			}
			if i < len(widths) {
				fmt.Fprintf(&b, "%-*s", widths[i], c)
			} else {
				b.WriteString(c)
			}
		}
		fmt.Fprintln(w, strings.TrimRight(b.String(), " "))
	}
	if t.Title != "" {
		fmt.Fprintln(w, t.Title)
	}
	line(t.Columns)
	sep := make([]string, len(widths))
	for i, n := range widths {
		sep[i] = strings.Repeat("-", n)
	}
	line(sep)
	for _, r := range t.Rows {
		line(r)
	}
}

// WriteCSV writes the table (header + rows) to path atomically, creating its
// directory.
func (t *Table) WriteCSV(path string) error {
	return WriteFileAtomic(path, func(w io.Writer) error {
		cw := csv.NewWriter(w)
		if err := cw.Write(t.Columns); err != nil {
			return err
		}
		if err := cw.WriteAll(t.Rows); err != nil {
			return err
		}
		cw.Flush()
		return cw.Error()
	})
}

// WriteFileAtomic writes path through a temp file in the same directory and
// renames it into place once write succeeded and the data is synced.
func WriteFileAtomic(path string, write func(io.Writer) error) error {
	dir := filepath.Dir(path)
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return err
	}
	return atomicfile.Write(path, 0o644, write)
}

// Measurement is one figure of a benchmark run, in long format: the rows of
// different systems (scenario "baseline", "lazyfork", ...) can share one CSV.
type Measurement struct {
	Scenario string // e.g. "baseline" (plain runc/CRIU restore) or "lazyfork"
	Metric   string // e.g. "restore_s", "memory_bytes"
	Subject  string // e.g. "copy-3"; "" for a whole-run figure
	Value    float64
	Unit     string // "s", "bytes", "count"
}

// Measurements is a run's figures.
type Measurements []Measurement

// Add appends one figure.
func (m *Measurements) Add(scenario, metric, subject string, value float64, unit string) {
	*m = append(*m, Measurement{scenario, metric, subject, value, unit})
}

// Table returns the figures as a table with columns
// scenario, metric, subject, value, unit.
func (m Measurements) Table() *Table {
	t := &Table{Columns: []string{"scenario", "metric", "subject", "value", "unit"}}
	for _, x := range m {
		v := strconv.FormatFloat(x.Value, 'f', -1, 64)
		if x.Unit == "s" {
			v = strconv.FormatFloat(x.Value, 'f', 4, 64)
		}
		t.Rows = append(t.Rows, []string{x.Scenario, x.Metric, x.Subject, v, x.Unit})
	}
	return t
}

// MB formats bytes as decimal megabytes with one decimal.
func MB(b int64) string { return strconv.FormatFloat(float64(b)/1e6, 'f', 1, 64) + " MB" }

// Number is what Median, Min and Max take: durations, byte counts, float figures.
type Number interface{ ~int64 | ~float64 }

// Median of vs (0 for none); the mean of the two middle values for an even
// count.
func Median[T Number](vs []T) T {
	if len(vs) == 0 {
		return 0
	}
	s := slices.Clone(vs)
	slices.Sort(s)
	if len(s)%2 == 1 {
		return s[len(s)/2]
	}
	return (s[len(s)/2-1] + s[len(s)/2]) / 2
}

// Max of vs (0 for none).
func Max[T Number](vs []T) T {
	var m T
	for i, v := range vs {
		if i == 0 || v > m {
			m = v
		}
	}
	return m
}

// Min of vs (0 for none).
func Min[T Number](vs []T) T {
	var m T
	for i, v := range vs {
		if i == 0 || v < m {
			m = v
		}
	}
	return m
}
