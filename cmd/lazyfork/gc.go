package main

import (
	"errors"
	"fmt"

	"github.com/spf13/pflag"
)

func init() {
	var dry bool
	register(&command{
		name:  "gc",
		args:  "[--dry-run]",
		short: "undo forks whose process died mid-way (thaw their parents, remove half-made copies, snapshots, leases), remove orphaned snapshots, the logs of containers other tools removed, and memory references whose task is gone (with the memory files only they held; lazyfork-snapshotter also frees those every --memory-gc-interval, a minute by default)",
		example: `  lazyfork gc             # prints one line per object removed
  lazyfork gc --dry-run   # prints what it would remove`,
		flags: func(fs *pflag.FlagSet) {
			fs.BoolVar(&dry, "dry-run", false, "only print what would be removed")
		},
		run: func(a *app, fs *pflag.FlagSet, pos, _ []string) error {
			if err := needArgs(pos, 0, "no arguments"); err != nil {
				return err
			}
			rep, err := a.lf.GC(a.ctx, dry)
			verb := "removed"
			if dry {
				verb = "would remove"
			}
			for _, r := range rep.Removed {
				fmt.Fprintf(a.out, "%s %s\n", verb, r)
			}
			logs, lerr := a.sweepLogs(dry)
			for _, p := range logs {
				fmt.Fprintf(a.out, "%s log %s (its container is gone)\n", verb, p)
			}
			return errors.Join(err, lerr)
		},
	})
}
