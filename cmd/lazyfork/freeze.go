package main

import (
	"fmt"

	"github.com/spf13/pflag"
)

func init() {
	for _, c := range []struct{ name, short string }{
		{"freeze", "pause a container's processes (cgroup freezer)"},
		{"thaw", "resume a frozen container"},
	} {
		name := c.name
		register(&command{
			name:    name,
			args:    "NAME",
			short:   c.short,
			example: "  lazyfork " + name + " counter",
			run: func(a *app, fs *pflag.FlagSet, pos, _ []string) error {
				ctr, err := a.loadOne(pos)
				if err != nil {
					return err
				}
				task, err := ctr.Task(a.ctx, nil)
				if err != nil {
					return fmt.Errorf("%s: no running task: %w", ctr.ID(), err)
				}
				if name == "freeze" {
					err = task.Pause(a.ctx)
				} else {
					err = task.Resume(a.ctx)
				}
				if err != nil {
					return fmt.Errorf("%s %s: %w", name, ctr.ID(), err)
				}
				fmt.Fprintln(a.out, ctr.ID())
				return nil
			},
		})
	}
}
