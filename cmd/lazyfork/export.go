//go:build linux

package main

import (
	"fmt"
	"os"
	"strings"

	"github.com/containerd/errdefs"
	"github.com/spf13/pflag"

	"github.com/lazyfork/lazyfork/client"
	snapclient "github.com/lazyfork/lazyfork/snapshotter/client"
)

func init() {
	register(&command{
		name:  "export",
		args:  "NAME|SNAPSHOT -o FILE",
		short: "write a container's snapshot as a standard checkpoint archive (checkpointctl, runc/CRIU and CRI restore read it; lazyfork import brings it back)",
		example: `  lazyfork export counter -o counter.tar      # snapshots a running container now
  lazyfork export /run/lazyfork/snapshots/ID -o snap.tar
  checkpointctl inspect --all counter.tar`,
		flags: func(fs *pflag.FlagSet) {
			fs.StringP("output", "o", "", "the archive to write (must not exist)")
		},
		run: func(a *app, fs *pflag.FlagSet, pos, _ []string) error {
			out := flagString(fs, "output")
			if err := needArgs(pos, 1, "NAME|SNAPSHOT"); err != nil {
				return err
			}
			if out == "" {
				return fmt.Errorf("export: -o FILE is required: %w", errdefs.ErrInvalidArgument)
			}
			ref := pos[0]
			if !strings.Contains(ref, "/") {
				id, err := a.resolve(ref)
				if err != nil {
					return err
				}
				ref = id
			}
			res, err := a.onNode().Export(a.ctx, ref, out)
			if err != nil {
				return err
			}
			fmt.Fprintf(a.out, "%s exported to %s (%d pages, %d bytes)\n", res.Container, res.Archive, res.Pages, res.Bytes)
			return nil
		},
	})
	register(&command{
		name:  "import",
		args:  "FILE",
		short: "make a checkpoint archive (lazyfork export, or a CRI/kubelet checkpoint) a stopped LazyFork container to fork",
		example: `  lazyfork import counter.tar --name counter2
  lazyfork fork counter2 --count 3`,
		flags: func(fs *pflag.FlagSet) {
			fs.String("name", "", "the container's name (default: the archive's)")
			fs.String("snapshotter", "", "snapshotter of its rootfs (default: LazyFork's if containerd has it, else overlayfs)")
			fs.String("cgroup-parent", "", "cgroup of the container and its forks (default: beside the archive's container's)")
		},
		run: func(a *app, fs *pflag.FlagSet, pos, _ []string) error {
			if err := needArgs(pos, 1, "FILE"); err != nil {
				return err
			}
			if _, err := os.Stat(pos[0]); err != nil {
				return fmt.Errorf("import: %w: %w", err, errdefs.ErrNotFound)
			}
			sn := flagString(fs, "snapshotter")
			if sn == "" {
				sn = "overlayfs"
				if a.hasSnapshotter(snapclient.SnapshotterName) {
					sn = snapclient.SnapshotterName
				}
			}
			opts := []client.ImportOpt{client.WithImportName(flagString(fs, "name")), client.WithImportSnapshotter(sn)}
			if p := flagString(fs, "cgroup-parent"); p != "" {
				opts = append(opts, client.WithImportCgroupParent(p))
			}
			res, err := a.onNode().Import(a.ctx, pos[0], opts...)
			if err != nil {
				return err
			}
			fmt.Fprintf(a.out, "%s imported (family %s, %d pages in memory files); fork it: lazyfork fork %s\n", res.Container, res.Family, res.Pages, res.Container)
			return nil
		},
	})
}

// flagString reads a string flag this file registered.
func flagString(fs *pflag.FlagSet, name string) string {
	if f := fs.Lookup(name); f != nil {
		return f.Value.String()
	}
	return ""
}

// onNode is a client working on LazyFork's files under --root in this process:
// export and import read and write snapshot images and memory files, which the
// node API does not carry, so they run on the node.
func (a *app) onNode() *client.Client { return client.New(a.cd, client.WithRoot(a.g.root)) }
