package main

import (
	"errors"
	"fmt"
	"path/filepath"

	containerd "github.com/containerd/containerd/v2/client"
	"github.com/containerd/errdefs"
	"github.com/spf13/pflag"

	"github.com/lazyfork/lazyfork/api"
)

func init() {
	var force bool
	register(&command{
		name:  "delete",
		args:  "[-f] NAME...",
		short: "delete stopped containers; -f also kills running ones (their forks keep running)",
		example: `  lazyfork delete counter        # refused while counter runs: stop it first
  lazyfork delete -f 3fa9 twin   # kill and delete running containers`,
		flags: func(fs *pflag.FlagSet) {
			fs.BoolVarP(&force, "force", "f", false, "kill a running (or paused) container's task, then delete it")
		},
		run: func(a *app, fs *pflag.FlagSet, pos, _ []string) error {
			if len(pos) == 0 {
				return fmt.Errorf("want NAME...: %w", errdefs.ErrInvalidArgument)
			}
			var errs []error
			for _, ref := range pos {
				id, err := a.resolve(ref)
				if err == nil {
					err = a.delete(id, force)
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
		name:  "clean",
		args:  "[--all-runtimes]",
		short: "delete every stopped LazyFork container (stopped with lazyfork stop, or whose process ended)",
		example: `  lazyfork clean
  lazyfork clean --all-runtimes   # also other runtimes' stopped containers`,
		run: func(a *app, fs *pflag.FlagSet, pos, _ []string) error {
			if err := needArgs(pos, 0, "no arguments"); err != nil {
				return err
			}
			rows, err := a.rows()
			if err != nil {
				return err
			}
			var errs []error
			for _, r := range rows {
				if r.State != "exited" && r.State != "stopped" {
					continue
				}
				if err := a.delete(r.ID, false); err != nil {
					if errdefs.IsFailedPrecondition(err) {
						continue // it started again meanwhile
					}
					errs = append(errs, err)
					continue
				}
				fmt.Fprintln(a.out, r.ID)
			}
			return errors.Join(errs...)
		},
	})
}

// delete removes container id and its log. Without force, a container whose
// task is not stopped (running, paused, ...) is refused, as ctr and nerdctl
// refuse it.
func (a *app) delete(id string, force bool) error {
	ctr, err := a.cd.LoadContainer(a.ctx, id)
	if err != nil {
		return fmt.Errorf("delete %s: %w", id, err)
	}
	if !force {
		if task, err := ctr.Task(a.ctx, nil); err == nil {
			st, err := task.Status(a.ctx)
			if err != nil && !errdefs.IsNotFound(err) {
				return fmt.Errorf("delete %s: task status: %w", id, err)
			}
			if err == nil && st.Status != containerd.Stopped && st.Status != containerd.Created {
				return fmt.Errorf("cannot delete %s: it is %s (end it with lazyfork stop, or kill it with delete -f): %w",
					id, st.Status, errdefs.ErrFailedPrecondition)
			}
		} else if !errdefs.IsNotFound(err) {
			return fmt.Errorf("delete %s: %w", id, err)
		}
	}
	var logPath string
	if l, err := ctr.Labels(a.ctx); err == nil {
		logPath = l[api.LabelLog]
	}
	if err := a.lf.Delete(a.ctx, id); err != nil {
		return err
	}
	if ownLog(logPath, a.g.namespace, id) {
		_ = a.lf.Node().RemoveLog(a.ctx, logPath)
	}
	return nil
}

// ownLog reports whether p is laid out as the log LazyFork gives container id
// of namespace ns (LOGDIR/NS/ID.log). The lazyfork.io/log label is not
// LazyFork's alone to write (CRI copies an image's labels onto its
// containers), so delete removes no other file it might name.
func ownLog(p, ns, id string) bool {
	return p != "" && filepath.IsAbs(p) && filepath.Base(p) == id+".log" && filepath.Base(filepath.Dir(p)) == ns
}
