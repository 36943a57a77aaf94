package client

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"sync"

	containerd "github.com/containerd/containerd/v2/client"
	"github.com/containerd/errdefs"
	"github.com/containerd/log"
	specs "github.com/opencontainers/runtime-spec/specs-go"
)

// Connect dials containerd at address (e.g. /run/containerd/containerd.sock)
// and returns a client working in namespace; Close closes the connection.
func Connect(address, namespace string, opts ...Opt) (*Client, error) {
	cd, err := containerd.New(address, containerd.WithDefaultNamespace(namespace))
	if err != nil {
		return nil, fmt.Errorf("connect to containerd at %s: %w", address, err)
	}
	c := New(cd, opts...)
	c.owned = true
	return c, nil
}

// Close closes the containerd connection if Connect made it.
func (c *Client) Close() error {
	if c.owned && c.cd != nil {
		return c.cd.Close()
	}
	return nil
}

// Container is a LazyFork container found by Client.Container or made by Fork.
type Container struct {
	c  *Client
	id string
}

// ID is the containerd id.
func (x *Container) ID() string { return x.id }

// Container finds a container by id, name or unique id prefix.
func (c *Client) Container(ctx context.Context, name string) (*Container, error) {
	id, err := c.Resolve(ctx, name)
	if err != nil {
		return nil, err
	}
	return &Container{c: c, id: id}, nil
}

// Fork makes n running copies; each can fork again.
func (x *Container) Fork(ctx context.Context, n int, opts ...ForkOpt) (Forks, error) {
	res, err := x.c.Fork(ctx, x.id, n, opts...)
	if err != nil {
		return nil, err
	}
	forks := make(Forks, len(res.Forks))
	for i, f := range res.Forks {
		forks[i] = &Container{c: x.c, id: f.Container.ID()}
	}
	return forks, nil
}

// Exec runs argv in the container and returns its stdout; a non-zero exit is
// an error carrying its stderr.
func (x *Container) Exec(ctx context.Context, argv ...string) (string, error) {
	var stdout, stderr bytes.Buffer
	code, err := x.c.Exec(ctx, x.id, argv, nil, &stdout, &stderr, false)
	if err != nil {
		return stdout.String(), err
	}
	if code != 0 {
		return stdout.String(), fmt.Errorf("exec %v in %s: exit status %d: %s", argv, x.id, code, bytes.TrimSpace(stderr.Bytes()))
	}
	return stdout.String(), nil
}

// Delete removes the container (see Client.Delete).
func (x *Container) Delete(ctx context.Context) error { return x.c.Delete(ctx, x.id) }

// Forks is a set of forks; Close deletes them all.
type Forks []*Container

// IDs are the forks' container ids.
func (f Forks) IDs() []string {
	ids := make([]string, len(f))
	for i, x := range f {
		ids[i] = x.id
	}
	return ids
}

// Close deletes every fork (so `defer forks.Close()` cleans up).
func (f Forks) Close() error {
	var errs []error
	for _, x := range f {
		errs = append(errs, x.Delete(context.Background()))
	}
	return errors.Join(errs...)
}

// Exec runs argv in container id's task with the given stdio (stdin may be
// nil) and returns its exit status. The process runs with the task's
// environment and working directory.
func (c *Client) Exec(ctx context.Context, id string, argv []string, stdin io.Reader, stdout, stderr io.Writer, tty bool) (uint32, error) {
	ctr, err := c.cd.LoadContainer(ctx, id)
	if err != nil {
		return 0, err
	}
	spec, err := ctr.Spec(ctx)
	if err != nil {
		return 0, err
	}
	task, err := ctr.Task(ctx, nil)
	if err != nil {
		return 0, fmt.Errorf("exec in %s: no running task: %w", id, err)
	}
	ps := &specs.Process{Args: argv, Cwd: "/", Terminal: tty}
	if spec.Process != nil {
		ps.Env, ps.Cwd, ps.User = spec.Process.Env, spec.Process.Cwd, spec.Process.User
	}
	b := make([]byte, 6)
	_, _ = rand.Read(b)
	// The process sees its stdin end (EOF) when stdin does: containerd's
	// copy of stdin into the fifo ends, and CloseIO then closes the
	// process's end, as ctr does. The close waits until the process has
	// started (before that the shim has no stdin to close).
	var started chan containerd.Process
	if stdin != nil && !tty {
		started = make(chan containerd.Process, 1)
		stdin = &stdinCloser{r: stdin, started: started, ctx: context.WithoutCancel(ctx)}
	}
	p, err := task.Exec(ctx, "exec-"+hex.EncodeToString(b), ps, c.stdio(stdin, stdout, stderr, tty))
	if err != nil {
		if started != nil {
			close(started)
		}
		return 0, fmt.Errorf("exec in %s: %w", id, err)
	}
	defer p.Delete(context.WithoutCancel(ctx))
	ch, err := p.Wait(ctx)
	if err != nil {
		if started != nil {
			close(started)
		}
		return 0, err
	}
	if err := p.Start(ctx); err != nil {
		if started != nil {
			close(started)
		}
		return 0, fmt.Errorf("exec in %s: %w", id, err)
	}
	if started != nil {
		started <- p
	}
	if tty {
		c.ttyStarted(ctx, p)
	}
	st := <-ch
	p.IO().Wait()
	code, _, err := st.Result()
	return code, err
}

// stdinCloser passes stdin through and, at its end, closes the stdin of the
// process sent on started once it runs (nothing if started closes empty).
type stdinCloser struct {
	r       io.Reader
	started <-chan containerd.Process
	ctx     context.Context
	once    sync.Once
}

func (s *stdinCloser) Read(b []byte) (int, error) {
	n, err := s.r.Read(b)
	if err == io.EOF {
		s.once.Do(func() {
			if p, ok := <-s.started; ok {
				if cerr := p.CloseIO(s.ctx, containerd.WithStdinCloser); cerr != nil && !errdefs.IsNotFound(cerr) {
					log.G(s.ctx).WithError(cerr).Debug("lazyfork: close exec stdin")
				}
			}
		})
	}
	return n, err
}

// ttyStarted is replaced by the CLI to resize the terminal.
var ttyResize func(ctx context.Context, p containerd.Process)

func (c *Client) ttyStarted(ctx context.Context, p containerd.Process) {
	if ttyResize != nil {
		ttyResize(ctx, p)
	}
}

// SetTTYResize installs the function Exec calls once a TTY process started
// (the CLI follows the terminal's size with it).
func SetTTYResize(f func(ctx context.Context, p containerd.Process)) { ttyResize = f }
