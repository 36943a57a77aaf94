package main

import (
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"regexp"
	"strings"
	"text/tabwriter"
	"text/template"

	"github.com/containerd/errdefs"
	"github.com/spf13/pflag"
)

// formatUsage is the help of --format on every listing.
const formatUsage = "table, json, or a Go template applied to each item (as docker and nerdctl: '{{.ID}}', '{{json .}}', 'table {{.ID}}\\t{{.State}}')"

// addFormat registers --format on a listing.
func addFormat(fs *pflag.FlagSet, format *string) {
	fs.StringVar(format, "format", "table", formatUsage)
}

// output is a parsed --format: the built-in table, JSON, or a template.
type output struct {
	kind string // "table", "json" or "template"
	tmpl *template.Template
	// header: a "table TEMPLATE" format prints a header row and aligns
	// the columns.
	header string
}

// templateFuncs are the functions templates may call, as docker's.
var templateFuncs = template.FuncMap{
	"json": func(v any) (string, error) {
		b, err := json.Marshal(v)
		return string(b), err
	},
	"join":  strings.Join,
	"upper": strings.ToUpper,
	"lower": strings.ToLower,
	"human": human,
}

var fieldRef = regexp.MustCompile(`\{\{\s*\.(\w+)\s*\}\}`)

// parseFormat reads a --format value.
// listingFormat checks that a listing got no arguments and parses its --format.
func listingFormat(pos []string, format string) (*output, error) {
	if err := needArgs(pos, 0, "no arguments"); err != nil {
		return nil, err
	}
	return parseFormat(format)
}

func parseFormat(format string) (*output, error) {
	switch format {
	case "", "table":
		return &output{kind: "table"}, nil
	case "json":
		return &output{kind: "json"}, nil
	}
	o := &output{kind: "template"}
	text := format
	if t, ok := strings.CutPrefix(format, "table "); ok {
		text = t
		// The header: each {{.Field}} becomes FIELD, the rest is kept.
		h := fieldRef.ReplaceAllStringFunc(text, func(m string) string {
			return strings.ToUpper(fieldRef.FindStringSubmatch(m)[1])
		})
		o.header = unescapeTabs(h)
	}
	tmpl, err := template.New("format").Funcs(templateFuncs).Parse(unescapeTabs(text))
	if err != nil {
		return nil, fmt.Errorf("--format %q: %v (want table, json or a Go template such as '{{.ID}}'): %w", format, err, errdefs.ErrInvalidArgument)
	}
	o.tmpl = tmpl
	return o, nil
}

// unescapeTabs turns a typed \t into a tab, as docker does.
func unescapeTabs(s string) string { return strings.ReplaceAll(s, `\t`, "\t") }

// template writes each item through the template, one a line.
func (o *output) template(w io.Writer, items ...any) error {
	out := w
	var tw *tabwriter.Writer
	if o.header != "" {
		tw = tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
		out = tw
		fmt.Fprintln(tw, o.header)
	}
	for _, it := range items {
		var b bytes.Buffer
		if err := o.tmpl.Execute(&b, it); err != nil {
			return fmt.Errorf("--format: %v: %w", err, errdefs.ErrInvalidArgument)
		}
		b.WriteByte('\n')
		if _, err := out.Write(b.Bytes()); err != nil {
			return err
		}
	}
	if tw != nil {
		return tw.Flush()
	}
	return nil
}
