// Command lazyfork (shorthand lfork) forks running containers through
// containerd and LazyFork's runtime io.containerd.lazyfork.v1.
//
//	lazyfork [--address SOCK] [--namespace NS] [--root DIR] COMMAND [ARGS]
//
// Every command that takes NAME accepts a container's name (lazyfork's or
// nerdctl's), its id or a unique prefix of its id. Commands see and act on
// LazyFork's containers only, unless --all-runtimes. One file per command;
// `lazyfork help` lists them.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"sort"
	"strings"

	containerd "github.com/containerd/containerd/v2/client"
	"github.com/containerd/containerd/v2/pkg/namespaces"
	"github.com/containerd/errdefs"

	"github.com/lazyfork/lazyfork/api"
	"github.com/lazyfork/lazyfork/client"
)

// globals are the flags every command accepts, before or after its name.
type globals struct {
	address   string
	namespace string
	root      string
	// api is the node API's socket ("": the root's, see nodeOpt).
	api    string
	logDir string
	// allRuntimes: commands see and act on containers of every runtime,
	// not only LazyFork's (io.containerd.lazyfork.v1).
	allRuntimes bool
}

// command is one subcommand.
type command struct {
	name    string
	args    string // synopsis after the name
	short   string
	example string
	flags   func(fs *flag.FlagSet) // registers the command's own flags
	run     func(a *app, fs *flag.FlagSet, pos, cmd []string) error
	noConn  bool // needs no containerd connection
	hidden  bool // for LazyFork's own use: not in the command list
}

var commands = map[string]*command{}

func register(c *command) { commands[c.name] = c }

// app is what a running command has.
type app struct {
	g   globals
	ctx context.Context
	cd  *containerd.Client
	lf  *client.Client
	out io.Writer
}

func main() {
	if err := run(os.Args[1:]); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return
		}
		fmt.Fprintln(os.Stderr, "lazyfork:", err)
		var ec exitCode
		if errors.As(err, &ec) {
			os.Exit(int(ec))
		}
		os.Exit(1)
	}
}

// exitCode passes an exec'd process's status through.
type exitCode int

func (e exitCode) Error() string { return fmt.Sprintf("exit status %d", int(e)) }

func envOr(k, def string) string {
	if v := os.Getenv(k); v != "" {
		return v
	}
	return def
}

func defaultGlobals() globals {
	return globals{
		address:   envOr("CONTAINERD_ADDRESS", "/run/containerd/containerd.sock"),
		namespace: envOr("CONTAINERD_NAMESPACE", "default"),
		root:      envOr("LAZYFORK_ROOT", api.DefaultRoot),
		api:       os.Getenv("LAZYFORK_API"),
		logDir:    envOr("LAZYFORK_LOG_DIR", "/var/log/lazyfork/containers"),
	}
}

func addGlobals(fs *flag.FlagSet, g *globals) {
	fs.StringVar(&g.address, "address", g.address, "containerd socket ($CONTAINERD_ADDRESS)")
	fs.StringVar(&g.address, "a", g.address, "shorthand for --address")
	fs.StringVar(&g.namespace, "namespace", g.namespace, "containerd namespace ($CONTAINERD_NAMESPACE)")
	fs.StringVar(&g.namespace, "n", g.namespace, "shorthand for --namespace (before the command)")
	fs.StringVar(&g.root, "root", g.root, "LazyFork root: memory files and snapshots ($LAZYFORK_ROOT)")
	fs.StringVar(&g.api, "api", g.api, "LazyFork's node API socket (default: ROOT/snapshotter.sock.ttrpc) ($LAZYFORK_API)")
	fs.StringVar(&g.logDir, "log-dir", g.logDir, "where containers' output is logged ($LAZYFORK_LOG_DIR)")
	fs.BoolVar(&g.allRuntimes, "all-runtimes", g.allRuntimes, "also see and act on containers of other runtimes (runc, ...): by default only LazyFork's")
}

func mainUsage(w io.Writer) {
	fmt.Fprint(w, `lazyfork forks running containers (containerd runtime io.containerd.lazyfork.v1).

Usage: lazyfork [--address SOCK] [--namespace NS] [--root DIR] [--all-runtimes] COMMAND [ARGS]
NAME is a container's name (lazyfork's or nerdctl's), its id, or a unique prefix of its id.
Commands see and act on LazyFork's containers only (runtime io.containerd.lazyfork.v1)
unless --all-runtimes.

Commands:
`)
	names := make([]string, 0, len(commands))
	for n := range commands {
		names = append(names, n)
	}
	sort.Strings(names)
	for _, n := range names {
		c := commands[n]
		if c.hidden {
			continue
		}
		fmt.Fprintf(w, "  %-8s %s\n", n, c.short)
	}
	fmt.Fprint(w, `
Quick start:
  lazyfork setup
  lazyfork create --name counter localhost/lazyfork/busybox:latest -- sh -c 'i=0; while :; do echo $i; i=$((i+1)); sleep 1; done'
  lazyfork fork counter --name twin
  lazyfork attach twin

Run 'lazyfork COMMAND --help' for a command's flags and examples.
`)
}

func run(args []string) error {
	g := defaultGlobals()
	top := flag.NewFlagSet("lazyfork", flag.ContinueOnError)
	top.SetOutput(io.Discard)
	addGlobals(top, &g)
	help := top.Bool("help", false, "")
	top.BoolVar(help, "h", false, "")
	if err := top.Parse(args); err != nil {
		mainUsage(os.Stderr)
		return err
	}
	rest := top.Args()
	if *help || len(rest) == 0 || rest[0] == "help" {
		if len(rest) > 1 {
			if c := commands[rest[1]]; c != nil {
				return runCommand(c, g, []string{"--help"})
			}
		}
		mainUsage(os.Stdout)
		if len(rest) == 0 && !*help {
			return errors.New("no command given")
		}
		return nil
	}
	c := commands[rest[0]]
	if c == nil {
		mainUsage(os.Stderr)
		return fmt.Errorf("unknown command %q", rest[0])
	}
	return runCommand(c, g, rest[1:])
}

func runCommand(c *command, g globals, args []string) error {
	fs := flag.NewFlagSet("lazyfork "+c.name, flag.ContinueOnError)
	addGlobalsLong(fs, &g)
	if c.flags != nil {
		c.flags(fs)
	}
	fs.Usage = func() {
		w := fs.Output()
		fmt.Fprintf(w, "Usage: lazyfork %s %s\n\n%s\n\nFlags:\n", c.name, c.args, c.short)
		fs.PrintDefaults()
		if c.example != "" {
			fmt.Fprintf(w, "\nExamples:\n%s\n", c.example)
		}
	}
	// Everything after "--" is a command line for the container.
	var cmd []string
	for i, a := range args {
		if a == "--" {
			args, cmd = args[:i], args[i+1:]
			break
		}
	}
	// Flags may come before or after the positional arguments.
	var pos []string
	for {
		if err := fs.Parse(args); err != nil {
			return err
		}
		args = fs.Args()
		if len(args) == 0 {
			break
		}
		pos = append(pos, args[0])
		args = args[1:]
	}
	a := &app{g: g, out: os.Stdout}
	a.ctx = namespaces.WithNamespace(context.Background(), g.namespace)
	if !c.noConn {
		if _, err := os.Stat(strings.TrimPrefix(g.address, "unix://")); err != nil {
			if errors.Is(err, os.ErrPermission) {
				return permissionDenied(g.address, err)
			}
			return fmt.Errorf("no containerd at %s (%w): start it, or run lazyfork setup", g.address, err)
		}
		cd, err := containerd.New(g.address, containerd.WithDefaultNamespace(g.namespace))
		if err != nil {
			if errors.Is(err, os.ErrPermission) || strings.Contains(err.Error(), "permission denied") {
				return permissionDenied(g.address, err)
			}
			return fmt.Errorf("connect to containerd at %s: %w (is it running? try lazyfork setup)", g.address, err)
		}
		defer cd.Close()
		a.cd = cd
		a.lf = client.New(cd, nodeOpt(g))
	} else {
		a.lf = client.New(nil, nodeOpt(g))
	}
	defer a.lf.Node().Close()
	return c.run(a, fs, pos, cmd)
}

// nodeOpt is how the client reaches LazyFork's root: through the node API
// (--api, else the root's socket, which lazyfork setup has
// lazyfork-snapshotter serve); only a root other than the default whose
// socket is missing (a private stack without the snapshotter, on this host)
// is worked on directly.
func nodeOpt(g globals) client.Opt {
	if g.api != "" {
		return client.WithAPI(g.api)
	}
	sock := api.Root(g.root).APISocket()
	if _, err := os.Stat(sock); err != nil && filepath.Clean(g.root) != api.DefaultRoot {
		return client.WithRoot(g.root)
	}
	return client.WithAPI(sock)
}

// permissionDenied is the error for a user who may not use containerd's
// socket: not "no containerd", which would send them to setup.
func permissionDenied(address string, err error) error {
	return fmt.Errorf("permission denied: run as root (containerd's socket %s is not open to uid %d: %v): %w",
		address, os.Getuid(), err, errdefs.ErrPermissionDenied)
}

// addGlobalsLong registers the long global flags on a command (the one-letter
// shorthands are for before the command, where -n is not fork's count).
func addGlobalsLong(fs *flag.FlagSet, g *globals) {
	fs.StringVar(&g.address, "address", g.address, "containerd socket ($CONTAINERD_ADDRESS)")
	fs.StringVar(&g.namespace, "namespace", g.namespace, "containerd namespace ($CONTAINERD_NAMESPACE)")
	fs.StringVar(&g.root, "root", g.root, "LazyFork root: memory files and snapshots ($LAZYFORK_ROOT)")
	fs.StringVar(&g.api, "api", g.api, "LazyFork's node API socket (default: ROOT/snapshotter.sock.ttrpc) ($LAZYFORK_API)")
	fs.StringVar(&g.logDir, "log-dir", g.logDir, "where containers' output is logged ($LAZYFORK_LOG_DIR)")
	fs.BoolVar(&g.allRuntimes, "all-runtimes", g.allRuntimes, "also see and act on containers of other runtimes (runc, ...): by default only LazyFork's")
}

// needArgs checks the count of positional arguments.
func needArgs(pos []string, n int, what string) error {
	if len(pos) != n {
		return fmt.Errorf("want %s, got %d argument(s) %q: %w", what, len(pos), pos, errdefs.ErrInvalidArgument)
	}
	return nil
}

// resolve maps NAME to a container id. A container of another runtime than
// LazyFork's is refused unless --all-runtimes: lazyfork leaves ctr's and
// nerdctl's runc containers alone.
func (a *app) resolve(ref string) (string, error) {
	id, err := a.lf.Resolve(a.ctx, ref)
	if err != nil || a.g.allRuntimes {
		return id, err
	}
	ctr, err := a.cd.LoadContainer(a.ctx, id)
	if err != nil {
		return "", err
	}
	info, err := ctr.Info(a.ctx, containerd.WithoutRefreshedMetadata)
	if err != nil {
		return "", err
	}
	if info.Runtime.Name != api.RuntimeName {
		return "", notLazyFork(id, info.Runtime.Name)
	}
	return id, nil
}

// notLazyFork is the error for a container of another runtime.
func notLazyFork(id, runtime string) error {
	return fmt.Errorf("%s runs under runtime %s, not LazyFork's %s: lazyfork leaves it alone (use ctr or nerdctl, or pass --all-runtimes): %w",
		id, orDash(runtime), api.RuntimeName, errdefs.ErrFailedPrecondition)
}

// loadOne loads the container the one NAME a command takes names.
func (a *app) loadOne(pos []string) (containerd.Container, error) {
	id, err := a.resolveOne(pos)
	if err != nil {
		return nil, err
	}
	return a.cd.LoadContainer(a.ctx, id)
}

// resolveOne resolves the one NAME a command takes.
func (a *app) resolveOne(pos []string) (string, error) {
	if err := needArgs(pos, 1, "NAME"); err != nil {
		return "", err
	}
	return a.resolve(pos[0])
}

// logPath is where container id's output goes.
func (a *app) logPath(id string) string {
	dir := a.g.logDir
	if !filepath.IsAbs(dir) {
		if abs, err := filepath.Abs(dir); err == nil {
			dir = abs
		}
	}
	return filepath.Join(dir, a.g.namespace, id+".log")
}

func short(s string, n int) string {
	if len(s) <= n {
		return s
	}
	return s[:n]
}

func orDash(s string) string {
	if strings.TrimSpace(s) == "" {
		return "-"
	}
	return s
}
