package main

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"os"
	"os/signal"
	"path/filepath"
	"syscall"

	containerd "github.com/containerd/containerd/v2/client"
	"github.com/containerd/containerd/v2/core/containers"
	"github.com/containerd/containerd/v2/pkg/cio"
	"github.com/containerd/containerd/v2/pkg/oci"
	"github.com/containerd/errdefs"
	specs "github.com/opencontainers/runtime-spec/specs-go"
	"github.com/spf13/pflag"

	"github.com/lazyfork/lazyfork/api"
	"github.com/lazyfork/lazyfork/client"
	"github.com/lazyfork/lazyfork/hook"
	snapclient "github.com/lazyfork/lazyfork/snapshotter/client"
)

func init() {
	var name, hookDir, snapshotter, pull, hostsDir string
	register(&command{
		name:  "create",
		args:  "IMAGE [--name N] [--pull missing|always|never] [--hook DIR] [-- CMD...]",
		short: "create and start a LazyFork container (forkable from its first instant)",
		example: `  lazyfork create python:3.12-slim --name counter -- python3 -c 'import itertools, time; [print(i, flush=True) or time.sleep(1) for i in itertools.count()]'
  lazyfork create --name agent --hook /run/lazyfork/hooks localhost/lazyfork/python:latest -- python3 /agent.py
A missing image is pulled (--pull missing, as nerdctl): python:3.12-slim is
docker.io/library/python:3.12-slim. The pull goes through containerd's transfer service
with the registry configuration of hosts.toml (the config_path of the containerd at
--address, else /etc/containerd/certs.d and /etc/docker/certs.d; --hosts-dir overrides)
and the credentials of docker's config.json ($DOCKER_CONFIG, ~/.docker; nerdctl login).
The container runs under io.containerd.lazyfork.v1, on the lazyfork snapshotter when
containerd has it (else overlayfs); its output goes to a log file (see attach).
With --hook, DIR/<id>/hook.sock on the host is /run/lazyfork-hook/hook.sock inside
($LAZYFORK_HOOK): LazyFork sends QUIESCE there before a snapshot and RESEED <id> after a restore.`,
		flags: func(fs *pflag.FlagSet) {
			fs.StringVar(&name, "name", "", "container name (also its id); default: a random id")
			fs.StringVar(&hookDir, "hook", "", "host directory for the runtime hook socket")
			fs.StringVar(&snapshotter, "snapshotter", "", "snapshotter (default: lazyfork if containerd has it, else overlayfs)")
			fs.StringVar(&pull, "pull", "missing", "pull the image: missing (when containerd lacks it), always, never")
			fs.StringVar(&hostsDir, "hosts-dir", "", "registry hosts.toml directories, ':'-separated (default: containerd's config_path, else /etc/containerd/certs.d:/etc/docker/certs.d)")
		},
		run: func(a *app, fs *pflag.FlagSet, pos, cmd []string) error {
			if err := needArgs(pos, 1, "IMAGE"); err != nil {
				return err
			}
			po := client.PullOptions{Address: a.g.address}
			var err error
			if po.Policy, err = client.ParsePullPolicy(pull); err != nil {
				return err
			}
			if hostsDir != "" {
				po.HostsDirs = filepath.SplitList(hostsDir)
			}
			po.Progress = os.Stderr
			po.Terminal = isTerminal(os.Stderr)
			id, err := a.create(pos[0], name, hookDir, snapshotter, cmd, po)
			if err != nil {
				return err
			}
			fmt.Fprintln(a.out, id)
			return nil
		},
	})
}

// hasSnapshotter tells whether containerd serves snapshotter name.
func (a *app) hasSnapshotter(name string) bool {
	resp, err := a.cd.IntrospectionService().Plugins(a.ctx, "type==io.containerd.snapshotter.v1,id=="+name)
	if err != nil || resp == nil {
		return false
	}
	for _, p := range resp.Plugins {
		if p.ID == name && p.InitErr == nil {
			return true
		}
	}
	return false
}

func randomID() string {
	b := make([]byte, 6)
	_, _ = rand.Read(b)
	return hex.EncodeToString(b)
}

func (a *app) create(ref, name, hookDir, sn string, cmd []string, po client.PullOptions) (string, error) {
	// The name first: a pull for a container that cannot be made is wasted.
	id := name
	if id == "" {
		id = randomID()
	} else if _, err := a.cd.LoadContainer(a.ctx, id); err == nil {
		return "", fmt.Errorf("a container named %q exists: %w", id, errdefs.ErrAlreadyExists)
	}
	if sn == "" {
		sn = "overlayfs"
		if a.hasSnapshotter(snapclient.SnapshotterName) {
			sn = snapclient.SnapshotterName
		}
	}
	po.Snapshotter = sn
	// Ctrl-C during a pull cancels it; the pull then removes what it fetched.
	pctx, stop := signal.NotifyContext(a.ctx, os.Interrupt, syscall.SIGTERM)
	img, err := a.lf.Image(pctx, ref, po)
	stop()
	if err != nil {
		return "", err
	}
	logPath := a.logPath(id)
	if err := a.lf.Node().PrepareLog(a.ctx, logPath); err != nil {
		return "", err
	}
	labels := map[string]string{api.LabelLog: logPath}
	if name != "" {
		labels[api.LabelName] = name
	}
	specOpts := []oci.SpecOpts{oci.WithImageConfig(img)}
	if a.lf.Root() == "" {
		specOpts[0] = imageConfigRemote(img)
	}
	if len(cmd) > 0 {
		specOpts = append(specOpts, oci.WithProcessArgs(cmd...))
	}
	if hookDir != "" {
		if hookDir, err = filepath.Abs(hookDir); err != nil {
			return "", err
		}
		if err := os.MkdirAll(filepath.Join(hookDir, id), 0o755); err != nil {
			return "", fmt.Errorf("hook dir: %w", err)
		}
		labels[api.LabelHook] = hookDir
		specOpts = append(specOpts,
			oci.WithMounts([]specs.Mount{{Destination: hook.ContainerDir, Type: "bind", Source: filepath.Join(hookDir, id), Options: []string{"rbind", "rw"}}}),
			oci.WithEnv([]string{hook.EnvSocket + "=" + hook.ContainerDir + "/" + hook.SocketName}))
	}
	ctr, err := a.cd.NewContainer(a.ctx, id,
		containerd.WithImage(img),
		containerd.WithSnapshotter(sn),
		containerd.WithNewSnapshot(id, img),
		containerd.WithNewSpec(specOpts...),
		containerd.WithRuntime(api.RuntimeName, nil),
		containerd.WithContainerLabels(labels),
	)
	if err != nil {
		return "", fmt.Errorf("create %s: %w", id, err)
	}
	task, err := ctr.NewTask(a.ctx, cio.LogFile(logPath))
	if err == nil {
		err = task.Start(a.ctx)
	}
	if err != nil {
		_ = a.lf.Delete(a.ctx, id)
		return "", fmt.Errorf("start %s: %w", id, err)
	}
	return id, nil
}

// imageConfigRemote is oci.WithImageConfig for a client of the node API:
// containerd's client mounts the new rootfs on its own host to read the
// image's /etc/passwd and /etc/group, which only works on the node. Here
// those two files are read from the image's layers through containerd
// (client.WriteImageUserFiles) into an otherwise empty directory.
func imageConfigRemote(img containerd.Image) oci.SpecOpts {
	return func(ctx context.Context, cl oci.Client, c *containers.Container, s *oci.Spec) error {
		empty, err := os.MkdirTemp("", "lazyfork-norootfs-")
		if err != nil {
			return err
		}
		defer os.RemoveAll(empty)
		_ = client.WriteImageUserFiles(ctx, img, empty) // without them: numeric users only
		nc := *c
		nc.Snapshotter, nc.SnapshotKey = "", ""
		if s.Root == nil {
			s.Root = &specs.Root{}
		}
		saved := s.Root.Path
		s.Root.Path = empty
		defer func() { s.Root.Path = saved }()
		if err := oci.WithImageConfig(img)(ctx, cl, &nc, s); err != nil {
			return fmt.Errorf("image config (the user is looked up in the image's /etc/passwd, read from its layers: give a numeric user if it has none): %w", err)
		}
		return nil
	}
}
