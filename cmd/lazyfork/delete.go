package main

import (
	"errors"
	"flag"
	"fmt"
	"os"

	"github.com/lazyfork/lazyfork/client"
)

func init() {
	register(&command{
		name:  "delete",
		args:  "NAME...",
		short: "delete containers (their forks keep running)",
		example: `  lazyfork delete counter
  lazyfork delete 3fa9 twin`,
		run: func(a *app, fs *flag.FlagSet, pos, _ []string) error {
			if len(pos) == 0 {
				return fmt.Errorf("want NAME...")
			}
			var errs []error
			for _, ref := range pos {
				id, err := a.resolve(ref)
				if err == nil {
					err = a.delete(id)
				}
				if err != nil {
					errs = append(errs, err)
					continue
				}
				fmt.Fprintln(a.out, id)
			}
			return errors.Join(errs...)
		},
	})
	register(&command{
		name:    "clean",
		args:    "",
		short:   "delete every stopped container (stopped with lazyfork stop, or whose process ended)",
		example: `  lazyfork clean`,
		run: func(a *app, fs *flag.FlagSet, pos, _ []string) error {
			rows, err := a.rows()
			if err != nil {
				return err
			}
			var errs []error
			for _, r := range rows {
				if r.State == "running" || r.State == "paused" || r.State == "created" || r.State == "pausing" {
					continue
				}
				if err := a.delete(r.ID); err != nil {
					errs = append(errs, err)
					continue
				}
				fmt.Fprintln(a.out, r.ID)
			}
			return errors.Join(errs...)
		},
	})
}

func (a *app) delete(id string) error {
	var logPath string
	if ctr, err := a.cd.LoadContainer(a.ctx, id); err == nil {
		if l, err := ctr.Labels(a.ctx); err == nil {
			logPath = l[client.LabelLog]
		}
	}
	if err := a.lf.Delete(a.ctx, id); err != nil {
		return err
	}
	if logPath != "" {
		os.Remove(logPath)
	}
	return nil
}
