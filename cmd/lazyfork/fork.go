package main

import (
	"errors"
	"fmt"
	"os"
	"os/signal"
	"strconv"
	"strings"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/containerd/console"
	containerd "github.com/containerd/containerd/v2/client"
	"github.com/containerd/containerd/v2/pkg/cio"
	"github.com/containerd/errdefs"
	"github.com/spf13/pflag"

	"github.com/lazyfork/lazyfork/api"
	"github.com/lazyfork/lazyfork/client"
	snapclient "github.com/lazyfork/lazyfork/snapshotter/client"
)

func init() {
	var n, maxForks, shimGroup int
	var name string
	var timeout time.Duration
	register(&command{
		name:  "fork",
		args:  "NAME [--count N] [--name N]",
		short: "make N running copies of a container (the parent keeps running); prints their ids",
		example: `  lazyfork fork counter --name twin     # one copy named twin
  lazyfork fork py --count 10           # ten copies (-c 10): ids printed one a line
  lazyfork fork twin                    # forks of forks work the same way
A stopped container (lazyfork stop) forks from its snapshot.`,
		flags: func(fs *pflag.FlagSet) {
			fs.IntVarP(&n, "count", "c", 1, "number of copies")
			fs.StringVar(&name, "name", "", "name (and id) of the copy; with --count N > 1: NAME-1 ... NAME-N")
			fs.IntVar(&maxForks, "max", 0, fmt.Sprintf("most copies one call may make (default %d, or $LAZYFORK_MAX_FORKS)", client.DefaultMaxForks))
			fs.DurationVar(&timeout, "timeout", client.DefaultRestoreTimeout, "bound on each copy's restore; a copy past it is removed and the fork fails")
			fs.IntVar(&shimGroup, "shim-group", client.DefaultShimGroupSize, "copies of the family that share a shim process, this call's and earlier ones' (each shim costs 7-10 MB; one that dies takes its group; 1: a shim each)")
		},
		run: func(a *app, fs *pflag.FlagSet, pos, _ []string) error {
			if err := needArgs(pos, 1, "NAME"); err != nil {
				return err
			}
			if n < 1 {
				return fmt.Errorf("--count %d: need at least one copy: %w", n, errdefs.ErrInvalidArgument)
			}
			if shimGroup < 1 {
				return fmt.Errorf("--shim-group %d: need at least 1: %w", shimGroup, errdefs.ErrInvalidArgument)
			}
			opts := []client.ForkOpt{client.WithTimeout(timeout), client.WithShimGroup(shimGroup)}
			if maxForks > 0 {
				opts = append(opts, client.WithMax(maxForks))
			}
			// Ctrl-C or SIGTERM cancels the whole call: what it made goes,
			// the parent runs on (the cleanup does not heed the signal).
			ctx, stopSignals := signal.NotifyContext(a.ctx, os.Interrupt, syscall.SIGTERM)
			defer stopSignals()
			id, err := a.lf.Resolve(ctx, pos[0])
			if err != nil {
				if _, nerr := strconv.Atoi(a.g.namespace); nerr == nil && fs.Changed("namespace") {
					// lazyfork fork NAME -n 10, as before cobra: -n is the namespace now.
					return fmt.Errorf("%w (-n is the namespace, here %q: the number of copies is --count or -c)", err, a.g.namespace)
				}
				return err
			}
			var ids []string
			if name != "" {
				if n == 1 {
					ids = []string{name}
				} else {
					for i := 1; i <= n; i++ {
						ids = append(ids, fmt.Sprintf("%s-%d", name, i))
					}
				}
			}
			if err := a.lf.Node().PrepareLog(ctx, a.logPath("x")); err != nil {
				return err
			}
			// Logs of forks that ctr or nerdctl removed go now.
			if _, err := a.sweepLogs(false); err != nil {
				fmt.Fprintf(os.Stderr, "lazyfork: %v\n", err)
			}
			var started atomic.Int64
			stop := make(chan struct{})
			done := make(chan struct{})
			bar := n > 1 && isTerminal(os.Stderr)
			go func() {
				defer close(done)
				if !bar {
					<-stop
					return
				}
				for {
					progress(int(started.Load()), n, false)
					select {
					case <-stop:
						return
					case <-time.After(100 * time.Millisecond):
					}
				}
			}()
			// A fork of nerdctl's container logs through nerdctl's driver
			// (the client's default for it), so that nerdctl logs reads it.
			nerdctlParent := false
			if pc, err := a.cd.LoadContainer(ctx, id); err == nil {
				if l, err := pc.Labels(ctx); err == nil {
					nerdctlParent = l[client.LabelNerdctlName] != "" && l["nerdctl/state-dir"] != ""
				}
			}
			if !nerdctlParent {
				opts = append(opts, client.WithIO(func(fid string) cio.Creator {
					started.Add(1)
					return cio.LogFile(a.logPath(fid))
				}))
			}
			if ids != nil {
				opts = append(opts, client.WithIDs(ids...))
			}
			res, err := a.lf.Fork(ctx, id, n, opts...)
			close(stop)
			<-done
			if err != nil {
				if bar {
					fmt.Fprintln(os.Stderr)
				}
				if ctx.Err() != nil && a.ctx.Err() == nil && !errors.Is(err, client.ErrCleanupIncomplete) {
					return fmt.Errorf("fork of %s interrupted: no copy was made, %s runs on (%w)", id, id, err)
				}
				return a.snapshotterHint(id, err)
			}
			if bar {
				progress(n, n, true)
			}
			if isTerminal(os.Stderr) {
				fmt.Fprintf(os.Stderr, "forked %s %d time(s): parent paused %.3f s, checkpoint %.3f s, restore %.3f s\n",
					id, n, res.Paused.Seconds(), res.Checkpoint.Seconds(), res.Restore.Seconds())
			}
			for _, f := range res.Forks {
				l := map[string]string{}
				if !nerdctlParent {
					l[api.LabelLog] = a.logPath(f.Container.ID())
				}
				if name != "" {
					l[api.LabelName] = f.Container.ID()
				}
				_, _ = f.Container.SetLabels(a.ctx, l)
				fmt.Fprintln(a.out, f.Container.ID())
			}
			return nil
		},
	})
}

func isTerminal(f *os.File) bool {
	_, err := console.ConsoleFromFile(f)
	return err == nil
}

func progress(k, n int, final bool) {
	const width = 30
	fill := width * k / n
	end := "\r"
	if final {
		end = "\n"
	}
	fmt.Fprintf(os.Stderr, "\rforking [%s%s] %d/%d%s", strings.Repeat("#", fill), strings.Repeat(" ", width-fill), k, n, end)
}

// snapshotterHint adds to a failed fork's error what to do when the cause is
// a dead lazyfork snapshotter (the parent's rootfs is on it).
func (a *app) snapshotterHint(id string, err error) error {
	ctr, lerr := a.cd.LoadContainer(a.ctx, id)
	if lerr != nil {
		return err
	}
	info, lerr := ctr.Info(a.ctx, containerd.WithoutRefreshedMetadata)
	if lerr != nil || info.Snapshotter != snapclient.SnapshotterName {
		return err
	}
	if perr := a.snapshotterAnswers(info.Snapshotter); perr != nil {
		return fmt.Errorf("%w\nthe lazyfork snapshotter, which holds %s's rootfs, does not answer: run lazyfork setup to start it, then lazyfork gc", err, id)
	}
	return err
}
