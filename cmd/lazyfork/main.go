// Command lazyfork (shorthand lfork) forks running containers through
// containerd and LazyFork's runtime io.containerd.lazyfork.v1.
//
//	lazyfork [--address SOCK] [-n|--namespace NS] [--root DIR] COMMAND [ARGS]
//
// The global flags go before or after COMMAND. Every command that takes NAME
// accepts a container's name (lazyfork's or nerdctl's), its id or a unique
// prefix of its id. Commands see and act on LazyFork's containers only,
// unless --all-runtimes. One file per command
// (it calls register in its init func; main.go makes a cobra.Command of
// it); `lazyfork help` lists them.
package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"

	containerd "github.com/containerd/containerd/v2/client"
	"github.com/containerd/containerd/v2/pkg/namespaces"
	"github.com/containerd/errdefs"
	"github.com/spf13/cobra"
	"github.com/spf13/pflag"

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

// command is one subcommand; each file registers its own in an init func.
// run gets the positional arguments (pos) and, when the command line has
// "--", what follows it (cmd: a command line for the container).
type command struct {
	name    string
	args    string // synopsis after the name; "NAME..." first: completes container names
	short   string
	example string
	flags   func(fs *pflag.FlagSet) // registers the command's own flags
	run     func(a *app, fs *pflag.FlagSet, pos, cmd []string) error
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
	g := globals{
		address:   envOr("CONTAINERD_ADDRESS", "/run/containerd/containerd.sock"),
		namespace: envOr("CONTAINERD_NAMESPACE", "default"),
		root:      envOr("LAZYFORK_ROOT", api.DefaultRoot),
		api:       os.Getenv("LAZYFORK_API"),
		logDir:    envOr("LAZYFORK_LOG_DIR", "/var/log/lazyfork/containers"),
	}
	vmDefaults(&g) // lazyfork vm start's forwarded sockets, while the VM runs
	return g
}

// addGlobals registers the global flags: persistent flags of the root
// command, so they go before or after the command's name.
func addGlobals(fs *pflag.FlagSet, g *globals) {
	fs.StringVarP(&g.address, "address", "a", g.address, "containerd socket ($CONTAINERD_ADDRESS)")
	fs.StringVarP(&g.namespace, "namespace", "n", g.namespace, "containerd namespace ($CONTAINERD_NAMESPACE)")
	fs.StringVar(&g.root, "root", g.root, "LazyFork root: memory files and snapshots ($LAZYFORK_ROOT)")
	fs.StringVar(&g.api, "api", g.api, "LazyFork's node API socket (default: ROOT/snapshotter.sock.ttrpc) ($LAZYFORK_API)")
	fs.StringVar(&g.logDir, "log-dir", g.logDir, "where containers' output is logged ($LAZYFORK_LOG_DIR)")
	fs.BoolVar(&g.allRuntimes, "all-runtimes", g.allRuntimes, "also see and act on containers of other runtimes (runc, ...): by default only LazyFork's")
}

const rootLong = `lazyfork forks running containers (containerd runtime io.containerd.lazyfork.v1).

NAME is a container's name (lazyfork's or nerdctl's), its id, or a unique prefix of its id.
Commands see and act on LazyFork's containers only (runtime io.containerd.lazyfork.v1)
unless --all-runtimes. Global flags go before or after the command.`

const rootExample = `  lazyfork setup
  lazyfork create --name counter localhost/lazyfork/busybox:latest -- sh -c 'i=0; while :; do echo $i; i=$((i+1)); sleep 1; done'
  lazyfork fork counter --name twin
  lazyfork attach twin
  source <(lazyfork completion bash)     # shell completion (also zsh, fish)`

// cli is one parse and run of a command line.
type cli struct {
	g    globals
	out  io.Writer
	ran  bool     // a command's run began: its errors are not usage errors
	args []string // the command line
}

// run parses args (os.Args[1:]) and runs the command they name.
func run(args []string) error { return execute(args, os.Stdout, os.Stderr) }

// execute is run with the output (help, and what commands print) to out,
// cobra's own messages to errOut.
func execute(args []string, out, errOut io.Writer) error {
	x := &cli{g: defaultGlobals(), out: out, args: args}
	root := x.newRoot()
	root.SetOut(out)
	root.SetErr(errOut)
	root.SetArgs(singleDashLong(root, args))
	found, err := root.ExecuteC()
	if err == nil || x.ran {
		return err
	}
	hint := fmt.Sprintf("Run '%s --help' for its flags and examples.", found.CommandPath())
	if strings.HasPrefix(err.Error(), "unknown command") {
		hint = "Run 'lazyfork help' for the list of commands."
	}
	return usageError{err: err, hint: hint}
}

// usageError is a command line cobra could not parse, with what to do.
type usageError struct {
	err  error
	hint string
}

func (e usageError) Error() string {
	return strings.TrimRight(e.err.Error(), "\n") + "\n" + e.hint
}
func (e usageError) Unwrap() error        { return e.err }
func (e usageError) Is(target error) bool { return target == errdefs.ErrInvalidArgument }

// newRoot builds the command tree: the root with the global flags, and a
// cobra.Command per registered command.
func (x *cli) newRoot() *cobra.Command {
	root := &cobra.Command{
		Use:           "lazyfork",
		Short:         "fork running containers",
		Long:          rootLong,
		Example:       rootExample,
		Version:       versionString(),
		SilenceErrors: true,
		SilenceUsage:  true,
		// lazyfork alone prints the command list, and fails as before.
		RunE: func(cmd *cobra.Command, args []string) error {
			x.ran = true
			_ = cmd.Help()
			return errors.New("no command given")
		},
	}
	root.SetVersionTemplate("lazyfork version {{.Version}}\n")
	addGlobals(root.PersistentFlags(), &x.g)
	_ = root.RegisterFlagCompletionFunc("namespace", x.completeNamespaces)
	for _, c := range commands {
		root.AddCommand(x.cobraCommand(c))
	}
	return root
}

// cobraCommand turns a registered command into a cobra.Command.
func (x *cli) cobraCommand(c *command) *cobra.Command {
	cc := &cobra.Command{
		Use:                   strings.TrimSpace(c.name + " " + c.args),
		Short:                 c.short,
		Example:               c.example,
		Hidden:                c.hidden,
		DisableFlagsInUseLine: true,
		ValidArgsFunction:     x.nameCompletion(c.args),
		RunE: func(cmd *cobra.Command, args []string) error {
			x.ran = true
			// Everything after "--" is a command line for the container.
			pos, rest := args, []string(nil)
			if d := cmd.ArgsLenAtDash(); d >= 0 {
				pos, rest = args[:d], args[d:]
			}
			return x.runCommand(c, cmd.Flags(), pos, rest)
		},
	}
	if c.flags != nil {
		// A one-letter flag declared as Go's flag package would have it
		// (fs.StringVar(&out, "o", ...)) is -o too, not only --o.
		fs := pflag.NewFlagSet(c.name, pflag.ContinueOnError)
		c.flags(fs)
		fs.VisitAll(func(f *pflag.Flag) {
			if len(f.Name) == 1 && f.Shorthand == "" {
				f.Shorthand = f.Name
			}
			cc.Flags().AddFlag(f)
		})
	}
	return cc
}

// singleDashLong rewrites -name (a long flag with one dash, which Go's flag
// package, and so lazyfork before cobra, accepted) as --name; without it
// -name would silently be -n ame, the namespace "ame". Only known long flag
// names, and nothing after "--".
func singleDashLong(root *cobra.Command, args []string) []string {
	long := map[string]bool{}
	add := func(f *pflag.Flag) { long[f.Name] = true }
	root.PersistentFlags().VisitAll(add)
	for _, c := range root.Commands() {
		c.Flags().VisitAll(add)
	}
	out := make([]string, 0, len(args))
	for i, a := range args {
		if a == "--" {
			return append(out, args[i:]...)
		}
		if len(a) > 2 && a[0] == '-' && a[1] != '-' {
			if name, _, _ := strings.Cut(a[1:], "="); len(name) > 1 && long[name] {
				a = "-" + a
			}
		}
		out = append(out, a)
	}
	return out
}

// runCommand connects to containerd (unless c.noConn) and runs c.
func (x *cli) runCommand(c *command, fs *pflag.FlagSet, pos, cmd []string) error {
	g := x.g
	a := &app{g: g, out: x.out}
	a.ctx = namespaces.WithNamespace(context.Background(), g.namespace)
	if !c.noConn {
		cd, err := connect(g)
		if err != nil {
			return err
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

// connect opens containerd's socket, with errors that say what to do.
func connect(g globals, opts ...containerd.Opt) (*containerd.Client, error) {
	if _, err := os.Stat(strings.TrimPrefix(g.address, "unix://")); err != nil {
		if errors.Is(err, os.ErrPermission) {
			return nil, permissionDenied(g.address, err)
		}
		return nil, fmt.Errorf("no containerd at %s (%w): %s", g.address, err, stackHint())
	}
	cd, err := containerd.New(g.address, append([]containerd.Opt{containerd.WithDefaultNamespace(g.namespace)}, opts...)...)
	if err != nil {
		if errors.Is(err, os.ErrPermission) || strings.Contains(err.Error(), "permission denied") {
			return nil, permissionDenied(g.address, err)
		}
		return nil, fmt.Errorf("connect to containerd at %s: %w (is it running? try lazyfork setup)", g.address, err)
	}
	return cd, nil
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
