package main

import (
	"io"
	"reflect"
	"testing"
)

func TestSplitWords(t *testing.T) {
	for in, want := range map[string][]string{
		`prog a b`:                    {"prog", "a", "b"},
		`python3 -c 'import x; y()'`:  {"python3", "-c", "import x; y()"},
		`sh -c "echo \"hi\" $x" tail`: {"sh", "-c", `echo "hi" $x`, "tail"},
		`a\ b  ''`:                    {"a b", ""},
	} {
		got, err := splitWords(in)
		if err != nil || !reflect.DeepEqual(got, want) {
			t.Errorf("splitWords(%q) = %q, %v; want %q", in, got, err, want)
		}
	}
	if _, err := splitWords(`a 'b`); err == nil {
		t.Error("unterminated quote accepted")
	}
}

func TestFlagErrors(t *testing.T) {
	for _, args := range [][]string{
		{},                                // nothing to run
		{"--cmd", "x", "--workload", "c"}, // two sources
		{"--workload", "rust"},            // unknown workload
		{"--workload", "c", "-n", "0"},    // no copies
		{"--workload", "c", "--generations", "0"},
		{"--pid", "-3"},
		{"--cmd", "   "},
		{"--workload", "c", "extra"},
	} {
		if _, err := parseFlags(args, io.Discard); err == nil {
			t.Errorf("parseFlags(%q) accepted", args)
		}
	}
	c, err := parseFlags([]string{"--workload", "go", "-n", "5", "--generations", "3"}, io.Discard)
	if err != nil || c.n != 5 || c.generations != 3 || c.workload != "go" {
		t.Fatalf("%+v %v", c, err)
	}
}
