package main

import (
	"context"
	"fmt"
	"os"

	"github.com/containerd/console"
	containerd "github.com/containerd/containerd/v2/client"
	"github.com/containerd/log"
	"github.com/spf13/pflag"

	"github.com/lazyfork/lazyfork/client"
)

func init() {
	var tty bool
	register(&command{
		name:  "exec",
		args:  "NAME [-t] -- CMD...",
		short: "run a command in a running container; its exit status is lazyfork's",
		example: `  lazyfork exec twin -- cat /proc/self/status
  lazyfork exec counter -t -- sh`,
		flags: func(fs *pflag.FlagSet) { fs.BoolVarP(&tty, "tty", "t", false, "allocate a terminal") },
		run: func(a *app, fs *pflag.FlagSet, pos, cmd []string) error {
			if err := needArgs(pos, 1, "NAME"); err != nil {
				return err
			}
			if len(cmd) == 0 {
				return fmt.Errorf("want -- CMD...")
			}
			return a.exec(pos[0], cmd, tty)
		},
	})
	register(&command{
		name:    "shell",
		args:    "NAME",
		short:   "an interactive shell (/bin/sh, TTY) in a running container",
		example: `  lazyfork shell twin`,
		run: func(a *app, fs *pflag.FlagSet, pos, _ []string) error {
			if err := needArgs(pos, 1, "NAME"); err != nil {
				return err
			}
			return a.exec(pos[0], []string{"/bin/sh"}, isTerminal(os.Stdin))
		},
	})
}

func (a *app) exec(ref string, argv []string, tty bool) error {
	id, err := a.resolve(ref)
	if err != nil {
		return err
	}
	var code uint32
	if tty {
		con := console.Current()
		if err := con.SetRaw(); err != nil {
			return err
		}
		defer con.Reset()
		setResize(con)
		code, err = a.lf.Exec(a.ctx, id, argv, con, con, nil, true)
	} else {
		var stdin *os.File
		if !isTerminal(os.Stdin) {
			stdin = os.Stdin
		}
		if stdin != nil {
			code, err = a.lf.Exec(a.ctx, id, argv, stdin, os.Stdout, os.Stderr, false)
		} else {
			code, err = a.lf.Exec(a.ctx, id, argv, nil, os.Stdout, os.Stderr, false)
		}
	}
	if err != nil {
		return err
	}
	if code != 0 {
		return exitCode(code)
	}
	return nil
}

func setResize(con console.Console) {
	resize := func(ctx context.Context, p containerd.Process) {
		if ws, err := con.Size(); err == nil {
			if err := p.Resize(ctx, uint32(ws.Width), uint32(ws.Height)); err != nil {
				log.G(ctx).WithError(err).Debug("resize")
			}
		}
	}
	client.SetTTYResize(resize)
}
