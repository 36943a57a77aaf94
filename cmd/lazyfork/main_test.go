package main

import (
	"bytes"
	"errors"
	"net"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/containerd/errdefs"
	"github.com/spf13/pflag"
)

// Every command answers --help with its usage, its flags and examples, and
// no error; help CMD too.
func TestHelp(t *testing.T) {
	for name, c := range commands {
		for _, args := range [][]string{{name, "--help"}, {name, "-h"}, {"help", name}} {
			var out bytes.Buffer
			if err := execute(args, &out, &out); err != nil {
				t.Errorf("%s: %v", args, err)
			}
			help := out.String()
			if !strings.Contains(help, "lazyfork "+name) || !strings.Contains(help, "--namespace") {
				t.Errorf("%s: no usage line or global flags:\n%s", args, help)
			}
			fs := pflag.NewFlagSet(name, pflag.ContinueOnError)
			if c.flags != nil {
				c.flags(fs)
			}
			fs.VisitAll(func(f *pflag.Flag) {
				if !strings.Contains(help, "--"+f.Name) {
					t.Errorf("%s: flag --%s not shown:\n%s", args, f.Name, help)
				}
			})
		}
		if c.example == "" {
			t.Errorf("%s has no examples", name)
		}
	}
	var out bytes.Buffer
	if err := execute([]string{"help"}, &out, &out); err != nil {
		t.Errorf("help: %v", err)
	}
	for name, c := range commands {
		if listed := strings.Contains(out.String(), "\n  "+name+" "); listed == c.hidden {
			t.Errorf("help lists %s: %v, but hidden is %v", name, listed, c.hidden)
		}
	}
}

func TestBadInput(t *testing.T) {
	err := run([]string{"nosuch"})
	if err == nil || !strings.Contains(err.Error(), `unknown command "nosuch"`) || !strings.Contains(err.Error(), "lazyfork help") {
		t.Errorf("unknown command: %v", err)
	}
	if !errors.Is(err, errdefs.ErrInvalidArgument) {
		t.Errorf("unknown command: %v is not invalid argument", err)
	}
	err = run([]string{"list", "--bogus"})
	if err == nil || !strings.Contains(err.Error(), "unknown flag: --bogus") || !strings.Contains(err.Error(), "lazyfork list --help") {
		t.Errorf("unknown flag: %v", err)
	}
	// lazyfork alone prints the command list, and fails.
	var out bytes.Buffer
	if err := execute(nil, &out, &out); err == nil || !strings.Contains(out.String(), "fork ") {
		t.Errorf("no command: %v\n%s", err, out.String())
	}
	// No containerd at this address: a clear error, not a hang.
	sock := filepath.Join(t.TempDir(), "none.sock")
	err = run([]string{"--address", sock, "list"})
	if err == nil || !strings.Contains(err.Error(), "no containerd at "+sock) {
		t.Fatalf("list without containerd: %v", err)
	}
}

// parsed is what a command's run got.
type parsed struct {
	g        globals
	pos, cmd []string
	count    string
	name     string
}

// probe replaces command name's run (and its containerd connection) with
// one that records what it got, for the test.
func probe(t *testing.T, name string) *parsed {
	t.Helper()
	orig := commands[name]
	p := &parsed{}
	c := *orig
	c.noConn = true
	c.run = func(a *app, fs *pflag.FlagSet, pos, cmd []string) error {
		*p = parsed{g: a.g, pos: pos, cmd: cmd}
		if f := fs.Lookup("count"); f != nil {
			p.count = f.Value.String()
		}
		if f := fs.Lookup("name"); f != nil {
			p.name = f.Value.String()
		}
		return nil
	}
	commands[name] = &c
	t.Cleanup(func() { commands[name] = orig })
	return p
}

// The global flags go before or after the command; -n is the namespace
// everywhere, also after fork, whose count is --count (-c).
func TestGlobalsAndCount(t *testing.T) {
	t.Setenv("CONTAINERD_NAMESPACE", "envns")
	t.Setenv("CONTAINERD_ADDRESS", "/env.sock")
	p := probe(t, "fork")
	for _, tc := range []struct {
		args      []string
		ns, count string
		check     func(p *parsed) bool
	}{
		{args: []string{"fork", "x"}, ns: "envns", count: "1",
			check: func(p *parsed) bool { return p.g.address == "/env.sock" && !p.g.allRuntimes }},
		{args: []string{"--namespace", "a", "fork", "x"}, ns: "a", count: "1"},
		{args: []string{"-n", "b", "fork", "x"}, ns: "b", count: "1"},
		{args: []string{"fork", "x", "--namespace", "c"}, ns: "c", count: "1"},
		{args: []string{"fork", "x", "-n", "100"}, ns: "100", count: "1"},
		{args: []string{"fork", "-n", "d", "x", "--count", "3"}, ns: "d", count: "3"},
		{args: []string{"fork", "x", "-c", "4"}, ns: "envns", count: "4"},
		{args: []string{"fork", "x", "--count=5", "--name", "twin"}, ns: "envns", count: "5",
			check: func(p *parsed) bool { return p.name == "twin" }},
		// Go's flag package took -name for --name: still so, not -n ame.
		{args: []string{"fork", "x", "-name", "twin"}, ns: "envns", count: "1",
			check: func(p *parsed) bool { return p.name == "twin" }},
		{args: []string{"--address", "/a.sock", "--root", "/r", "fork", "x", "--log-dir", "/l", "--all-runtimes"}, ns: "envns", count: "1",
			check: func(p *parsed) bool {
				return p.g.address == "/a.sock" && p.g.root == "/r" && p.g.logDir == "/l" && p.g.allRuntimes
			}},
		{args: []string{"fork", "x", "-a", "/b.sock"}, ns: "envns", count: "1",
			check: func(p *parsed) bool { return p.g.address == "/b.sock" }},
		// After --: the container's command line, not lazyfork's flags.
		{args: []string{"fork", "x", "--", "sh", "-n", "e"}, ns: "envns", count: "1",
			check: func(p *parsed) bool { return strings.Join(p.cmd, " ") == "sh -n e" }},
	} {
		*p = parsed{}
		if err := run(tc.args); err != nil {
			t.Errorf("%q: %v", tc.args, err)
			continue
		}
		if p.g.namespace != tc.ns || p.count != tc.count || len(p.pos) != 1 || p.pos[0] != "x" || (tc.check != nil && !tc.check(p)) {
			t.Errorf("%q: got %+v, want namespace %s, count %s, NAME x", tc.args, *p, tc.ns, tc.count)
		}
	}
}

// A new command's one-letter flag, declared the way Go's flag package has
// it, is -o as well as --o.
func TestOneLetterFlag(t *testing.T) {
	var o string
	var pos []string
	commands["testonly"] = &command{
		name: "testonly", args: "NAME", noConn: true,
		flags: func(fs *pflag.FlagSet) { fs.StringVar(&o, "o", "", "output file") },
		run: func(a *app, fs *pflag.FlagSet, p, _ []string) error {
			pos = p
			return nil
		},
	}
	defer delete(commands, "testonly")
	for _, args := range [][]string{{"testonly", "x", "-o", "f"}, {"testonly", "--o=f", "x"}} {
		o, pos = "", nil
		if err := run(args); err != nil || o != "f" || len(pos) != 1 || pos[0] != "x" {
			t.Errorf("%q: %v, o=%q pos=%q", args, err, o, pos)
		}
	}
}

func TestVersion(t *testing.T) {
	for _, args := range [][]string{{"--version"}, {"version"}} {
		var out bytes.Buffer
		if err := execute(args, &out, &out); err != nil || !strings.HasPrefix(out.String(), "lazyfork version "+versionString()+"\n") {
			t.Errorf("%q: %v\n%s", args, err, out.String())
		}
	}
	version = "v9.8.7"
	defer func() { version = "" }()
	var out bytes.Buffer
	if err := execute([]string{"--version"}, &out, &out); err != nil || out.String() != "lazyfork version v9.8.7\n" {
		t.Errorf("--version with -X main.version: %v %q", err, out.String())
	}
}

func TestCompletionScripts(t *testing.T) {
	for shell, want := range map[string]string{"bash": "__start_lazyfork", "zsh": "#compdef lazyfork", "fish": "complete -c lazyfork"} {
		var out bytes.Buffer
		if err := execute([]string{"completion", shell}, &out, &out); err != nil || !strings.Contains(out.String(), want) {
			t.Errorf("completion %s: %v, no %q in\n%.300s", shell, err, want, out.String())
		}
	}
}

// Completing NAME with containerd down, or stuck (a socket that never
// answers), ends with no names rather than hanging the shell.
func TestCompletionWithoutContainerd(t *testing.T) {
	defer func(d time.Duration) { completionTimeout = d }(completionTimeout)
	completionTimeout = 200 * time.Millisecond
	dir := t.TempDir()
	stuck := filepath.Join(dir, "stuck.sock")
	l, err := net.Listen("unix", stuck)
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	go func() {
		for {
			c, err := l.Accept()
			if err != nil {
				return
			}
			defer c.Close() // accepted, never answered
		}
	}()
	for _, sock := range []string{filepath.Join(dir, "none.sock"), stuck} {
		for _, args := range [][]string{{"fork", ""}, {"delete", "x", ""}, {"--namespace", ""}} {
			var out bytes.Buffer
			full := append([]string{"__complete", "--address", sock}, args...)
			if err := execute(full, &out, &out); err != nil {
				t.Errorf("%q: %v", full, err)
			}
			if lines := strings.Split(strings.TrimSpace(out.String()), "\n"); lines[0] != ":4" {
				t.Errorf("%q: want no names and no file completion (:4), got\n%s", full, out.String())
			}
		}
	}
	// After "--": the container's command line, files as usual.
	var out bytes.Buffer
	if err := execute([]string{"__complete", "exec", "x", "--", ""}, &out, &out); err != nil || !strings.HasPrefix(out.String(), ":0\n") {
		t.Errorf("exec x -- : %v\n%s", err, out.String())
	}
}
