package main

import (
	"fmt"

	"github.com/spf13/pflag"
)

func init() {
	register(&command{
		name:  "stop",
		args:  "NAME",
		short: "snapshot a container, then end its process (it stays forkable and holds no process memory)",
		example: `  lazyfork stop counter
  lazyfork fork counter --name again    # restores from the snapshot`,
		run: func(a *app, fs *pflag.FlagSet, pos, _ []string) error {
			id, err := a.resolveOne(pos)
			if err != nil {
				return err
			}
			snap, err := a.lf.Stop(a.ctx, id)
			if err != nil {
				return err
			}
			fmt.Fprintf(a.out, "%s stopped (snapshot %s)\n", id, snap)
			return nil
		},
	})
}
