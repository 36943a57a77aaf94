package main

import (
	"flag"
	"fmt"
	"io"
	"os"
	"os/signal"
	"syscall"
	"time"

	"github.com/lazyfork/lazyfork/client"
)

func init() {
	var follow bool
	register(&command{
		name:  "attach",
		args:  "NAME [--follow=false]",
		short: "stream a container's output (from its log); Ctrl-C detaches, the container keeps running",
		example: `  lazyfork attach counter
  lazyfork attach twin --follow=false   # print what is there and return`,
		flags: func(fs *flag.FlagSet) { fs.BoolVar(&follow, "follow", true, "keep streaming new output") },
		run: func(a *app, fs *flag.FlagSet, pos, _ []string) error {
			ctr, err := a.loadOne(pos)
			if err != nil {
				return err
			}
			labels, err := ctr.Labels(a.ctx)
			if err != nil {
				return err
			}
			path := labels[client.LabelLog]
			if path == "" {
				return fmt.Errorf("%s has no LazyFork log (not made by lazyfork create or fork)", ctr.ID())
			}
			f, err := os.Open(path)
			if err != nil {
				return err
			}
			defer f.Close()
			sig := make(chan os.Signal, 1)
			signal.Notify(sig, os.Interrupt, syscall.SIGTERM)
			defer signal.Stop(sig)
			buf := make([]byte, 64<<10)
			for {
				n, err := f.Read(buf)
				if n > 0 {
					if _, werr := a.out.Write(buf[:n]); werr != nil {
						return nil
					}
				}
				if err == io.EOF {
					if !follow {
						return nil
					}
					select {
					case <-sig:
						return nil
					case <-time.After(100 * time.Millisecond):
					}
					continue
				}
				if err != nil {
					return err
				}
			}
		},
	})
}
