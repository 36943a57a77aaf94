package main

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/url"
	"os"
	"os/signal"
	"path/filepath"
	"strings"
	"syscall"
	"time"

	tasksapi "github.com/containerd/containerd/api/services/tasks/v1"
	containerd "github.com/containerd/containerd/v2/client"
	"github.com/containerd/errdefs"
	"github.com/containerd/errdefs/pkg/errgrpc"
	"github.com/spf13/pflag"

	"github.com/lazyfork/lazyfork/api"
	"github.com/lazyfork/lazyfork/node"
)

// nerdctl's labels on its containers.
const (
	labelNerdctlStateDir = "nerdctl/state-dir" // holds <id>-json.log (json-file driver)
)

func init() {
	var follow bool
	register(&command{
		name:  "logs",
		args:  "NAME [-f]",
		short: "print a container's output; -f follows it until the container ends (or Ctrl-C). Works for containers made by lazyfork, ctr and nerdctl",
		example: `  lazyfork logs twin
  lazyfork logs -f counter
The output is read where the container's task writes it: lazyfork's log file, a ctr
--log-uri file://, nerdctl's json-file log; for ctr run -d without --log-uri
(fifos nobody reads) -f streams it from now on.`,
		flags: func(fs *pflag.FlagSet) {
			fs.BoolVarP(&follow, "follow", "f", false, "keep printing new output until Ctrl-C")
		},
		run: func(a *app, fs *pflag.FlagSet, pos, _ []string) error {
			return a.logs(pos, follow)
		},
	})
	var attachFollow bool
	register(&command{
		name:  "attach",
		args:  "NAME [--follow=false]",
		short: "stream a container's output (lazyfork logs -f); Ctrl-C detaches, the container keeps running",
		example: `  lazyfork attach counter
  lazyfork attach twin --follow=false   # print what is there and return`,
		flags: func(fs *pflag.FlagSet) { fs.BoolVar(&attachFollow, "follow", true, "keep streaming new output") },
		run: func(a *app, fs *pflag.FlagSet, pos, _ []string) error {
			return a.logs(pos, attachFollow)
		},
	})
}

// logSource is where a container's output can be read.
type logSource struct {
	path string
	// kind: "file" (raw output), "json" (nerdctl's json-file lines) or
	// "fifo" (the task's stdout and stderr fifos: live output only).
	kind   string
	stderr string // kind fifo: the stderr fifo
}

// logSource finds where container ctr's output goes.
func (a *app) logSource(ctr containerd.Container) (logSource, error) {
	id := ctr.ID()
	labels, err := ctr.Labels(a.ctx)
	if err != nil {
		return logSource{}, err
	}
	if p := labels[api.LabelLog]; p != "" {
		return logSource{path: p, kind: "file"}, nil
	}
	if dir := labels[labelNerdctlStateDir]; dir != "" {
		p := filepath.Join(dir, id+"-json.log")
		if ok, _, err := a.lf.Node().StatLog(a.ctx, p); err == nil && ok {
			return logSource{path: p, kind: "json"}, nil
		}
	}
	resp, err := a.cd.TaskService().Get(a.ctx, &tasksapi.GetRequest{ContainerID: id})
	if err != nil {
		if errdefs.IsNotFound(errgrpc.ToNative(err)) {
			return logSource{}, fmt.Errorf("%s has no log: no log file was recorded and it has no task whose output could be read: %w", id, errdefs.ErrNotFound)
		}
		return logSource{}, fmt.Errorf("logs of %s: %w", id, errgrpc.ToNative(err))
	}
	out, errPath := resp.Process.Stdout, resp.Process.Stderr
	if out == "" {
		return logSource{}, fmt.Errorf("%s has no log: its task has no stdout (started with null IO): %w", id, errdefs.ErrNotFound)
	}
	if u, err := url.Parse(out); err == nil && u.Scheme != "" {
		switch u.Scheme {
		case "file":
			if u.Path == os.DevNull {
				return logSource{}, fmt.Errorf("%s has no log: its output is discarded (%s): %w", id, out, errdefs.ErrNotFound)
			}
			return logSource{path: u.Path, kind: "file"}, nil
		default:
			return logSource{}, fmt.Errorf("%s has no log lazyfork can read: its output goes to %s (read it with the tool that started it): %w", id, out, errdefs.ErrNotImplemented)
		}
	}
	if _, fifo, err := a.lf.Node().StatLog(a.ctx, out); err == nil && fifo {
		return logSource{path: out, stderr: errPath, kind: "fifo"}, nil
	}
	return logSource{path: out, kind: "file"}, nil
}

// logs prints the output of the container pos names; with follow it keeps
// printing until SIGINT or SIGTERM.
func (a *app) logs(pos []string, follow bool) error {
	ctr, err := a.loadOne(pos)
	if err != nil {
		return err
	}
	src, err := a.logSource(ctr)
	if err != nil {
		return err
	}
	ctx, stop := signal.NotifyContext(a.ctx, os.Interrupt, syscall.SIGTERM)
	defer stop()
	switch src.kind {
	case "fifo":
		if !follow {
			return fmt.Errorf("%s writes its output to fifos (started without a log file, e.g. ctr run -d without --log-uri): there is no past output to print; lazyfork logs -f %s streams it from now on: %w",
				ctr.ID(), ctr.ID(), errdefs.ErrNotFound)
		}
		return followFifos(ctx, a.lf.Node(), a.out, os.Stderr, src.path, src.stderr)
	case "json":
		return tailFile(ctx, a.lf.Node(), src.path, follow, a.ended(ctr), &jsonLogWriter{stdout: a.out, stderr: os.Stderr})
	}
	return tailFile(ctx, a.lf.Node(), src.path, follow, a.ended(ctr), a.out)
}

// ended tells whether ctr's process has ended (no task, or a stopped one):
// a follow then stops at the end of the log, as docker logs -f does.
func (a *app) ended(ctr containerd.Container) func() bool {
	return func() bool {
		task, err := ctr.Task(a.ctx, nil)
		if err != nil {
			return errdefs.IsNotFound(err)
		}
		st, err := task.Status(a.ctx)
		return err == nil && st.Status == containerd.Stopped
	}
}

// tailFile copies log path (the node's, read through n) to w; with follow
// it then waits for more until ctx ends or ended says the writer is gone
// (checked every second; the rest of the file is copied then).
func tailFile(ctx context.Context, n node.Node, path string, follow bool, ended func() bool, w io.Writer) error {
	r, err := n.ReadLog(ctx, path, follow)
	if err != nil {
		return fmt.Errorf("log %s: %w", path, err)
	}
	defer r.Close()
	if follow {
		stop := make(chan struct{})
		defer close(stop)
		go func() {
			for {
				select {
				case <-stop:
					return
				case <-time.After(time.Second):
				}
				if ended() {
					r.Finish()
					return
				}
			}
		}()
	}
	buf := make([]byte, 64<<10)
	for {
		k, err := r.Read(buf)
		if k > 0 {
			if _, werr := w.Write(buf[:k]); werr != nil {
				return nil // the reader went away (a closed pipe)
			}
		}
		if err == io.EOF {
			return nil
		}
		if err != nil {
			return err
		}
	}
}

// followFifos copies what the task writes to its stdout and stderr fifos
// (read through n) until ctx ends or the task closes them.
func followFifos(ctx context.Context, n node.Node, stdout, stderr io.Writer, outPath, errPath string) error {
	done := make(chan error, 2)
	k := 0
	for _, s := range []struct {
		path string
		w    io.Writer
	}{{outPath, stdout}, {errPath, stderr}} {
		if s.path == "" {
			continue
		}
		k++
		go func() {
			// The shim holds the write end: the open does not wait.
			r, err := n.ReadLog(ctx, s.path, false)
			if err != nil {
				done <- err
				return
			}
			defer r.Close()
			_, err = io.Copy(s.w, r)
			done <- err
		}()
	}
	for ; k > 0; k-- {
		select {
		case <-ctx.Done():
			return nil
		case err := <-done:
			if err != nil {
				return err
			}
		}
	}
	return nil
}

// jsonLogWriter turns nerdctl's json-file log lines ({"log": ..., "stream":
// "stdout"|"stderr", "time": ...}) back into the output.
type jsonLogWriter struct {
	stdout, stderr io.Writer
	partial        []byte
}

func (j *jsonLogWriter) Write(b []byte) (int, error) {
	j.partial = append(j.partial, b...)
	for {
		i := bytes.IndexByte(j.partial, '\n')
		if i < 0 {
			return len(b), nil
		}
		line := j.partial[:i]
		var e struct{ Log, Stream string }
		if err := json.Unmarshal(line, &e); err == nil {
			w := j.stdout
			if e.Stream == "stderr" {
				w = j.stderr
			}
			if _, err := io.WriteString(w, e.Log); err != nil {
				return 0, err
			}
		} else if len(strings.TrimSpace(string(line))) > 0 {
			fmt.Fprintf(j.stderr, "lazyfork: skipped a log line that is not JSON: %.80q\n", line)
		}
		j.partial = j.partial[i+1:]
	}
}
