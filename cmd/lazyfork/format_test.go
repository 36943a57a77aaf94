package main

import (
	"bytes"
	"strings"
	"testing"
)

func TestParseFormat(t *testing.T) {
	for _, f := range []string{"", "table"} {
		if o, err := parseFormat(f); err != nil || o.kind != "table" {
			t.Errorf("%q: %+v %v", f, o, err)
		}
	}
	if o, err := parseFormat("json"); err != nil || o.kind != "json" {
		t.Errorf("json: %+v %v", o, err)
	}
	if _, err := parseFormat("{{.ID"); err == nil || !strings.Contains(err.Error(), "Go template") {
		t.Errorf("a broken template: %v", err)
	}
	rows := []any{&row{ID: "a", State: "running", Memory: 3 << 20}, &row{ID: "b", State: "exited"}}
	for _, c := range []struct{ format, want string }{
		{"{{.ID}}", "a\nb\n"},
		{"{{.ID}} {{human .Memory}}", "a 3.0 MiB\nb -\n"},
		{`{{json .State}}`, "\"running\"\n\"exited\"\n"},
		{`table {{.ID}}\t{{.State}}`, "ID  STATE\na   running\nb   exited\n"},
	} {
		o, err := parseFormat(c.format)
		if err != nil {
			t.Fatalf("%q: %v", c.format, err)
		}
		var b bytes.Buffer
		if err := o.template(&b, rows...); err != nil || b.String() != c.want {
			t.Errorf("%q: %q %v, want %q", c.format, b.String(), err, c.want)
		}
	}
	// {{json .}} is the row as --format json writes it.
	o, _ := parseFormat("{{json .}}")
	var b bytes.Buffer
	if err := o.template(&b, rows[0]); err != nil || !strings.HasPrefix(b.String(), `{"id":"a","state":"running",`) {
		t.Errorf("{{json .}}: %s %v", b.String(), err)
	}
	// A field that does not exist names itself.
	o, _ = parseFormat("{{.Nope}}")
	if err := o.template(&b, rows[0]); err == nil || !strings.Contains(err.Error(), "Nope") {
		t.Errorf("unknown field: %v", err)
	}
}
