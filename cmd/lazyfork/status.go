package main

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/containerd/containerd/v2/core/leases"
	"github.com/containerd/containerd/v2/core/snapshots"
	"github.com/spf13/pflag"

	"golang.org/x/sys/unix"

	"github.com/lazyfork/lazyfork/internal/hwbreak"
	snapclient "github.com/lazyfork/lazyfork/snapshotter/client"
)

type statusReport struct {
	Host        string `json:"host"`
	Kernel      string `json:"kernel"`
	Containerd  string `json:"containerd"`
	Address     string `json:"address"`
	Namespace   string `json:"namespace"`
	Snapshotter string `json:"snapshotter"`
	// SnapshotterAlive: containerd has lazyfork's snapshotter and it answers.
	SnapshotterAlive bool   `json:"snapshotterAlive"`
	CRIU             string `json:"criu"`
	Root             string `json:"root"`
	Containers       int    `json:"containers"`
	Running          int    `json:"running"`
	Stopped          int    `json:"stopped"`
	Families         int    `json:"families"`
	MemFiles         int    `json:"memoryFiles"`
	MemBytes         int64  `json:"memoryFileBytes"`
	FamilyMem        int64  `json:"familyMemoryBytes"` // memory files + every container's cgroup usage
}

func init() {
	var format string
	register(&command{
		name:  "status",
		args:  "[--format table|json|TEMPLATE]",
		short: "host, containerd, snapshotter, CRIU and totals (containers, memory files, family memory)",
		example: `  lazyfork status
  lazyfork status --format json
  lazyfork status --format '{{.Snapshotter}}'`,
		flags: func(fs *pflag.FlagSet) { addFormat(fs, &format) },
		run: func(a *app, fs *pflag.FlagSet, pos, _ []string) error {
			o, err := listingFormat(pos, format)
			if err != nil {
				return err
			}
			s := statusReport{Address: a.g.address, Namespace: a.g.namespace, Root: a.g.root}
			s.Host, _ = os.Hostname()
			var u unix.Utsname
			if unix.Uname(&u) == nil {
				s.Kernel = unix.ByteSliceToString(u.Release[:])
			}
			if v, err := a.cd.Version(a.ctx); err == nil {
				s.Containerd = v.Version
			} else {
				s.Containerd = "unreachable: " + err.Error()
			}
			s.Snapshotter = "absent (overlayfs is used)"
			if a.hasSnapshotter(snapclient.SnapshotterName) {
				s.Snapshotter = snapclient.SnapshotterName + " (proxy plugin)"
				s.SnapshotterAlive = true
				if err := a.snapshotterAnswers(snapclient.SnapshotterName); err != nil {
					s.SnapshotterAlive = false
					s.Snapshotter = fmt.Sprintf("%s (proxy plugin) DEAD: it does not answer (%v): run lazyfork setup to start it", snapclient.SnapshotterName, err)
				}
			}
			s.CRIU = "not found"
			if out, err := exec.Command("criu", "--version").Output(); err == nil {
				s.CRIU = strings.TrimSpace(strings.SplitN(string(out), "\n", 2)[0])
				if ok, err := hwbreak.Work(); err == nil && !ok {
					s.CRIU += " (hardware breakpoints do not trap on this host: LazyFork runs CRIU with CRIU_FAULT=130)"
				}
			}
			rows, err := a.rows()
			if err != nil {
				return err
			}
			s.Containers = len(rows)
			for _, r := range rows {
				switch r.State {
				case "running", "paused":
					s.Running++
				case "stopped":
					s.Stopped++
				}
				s.FamilyMem += r.Memory
			}
			fams, err := a.families()
			if err != nil {
				return err
			}
			s.Families = len(fams)
			for _, f := range fams {
				s.MemFiles += len(f.Files)
				s.MemBytes += f.Bytes
			}
			s.FamilyMem += s.MemBytes
			switch o.kind {
			case "json":
				return writeJSON(a, s)
			case "template":
				return o.template(a.out, s)
			}
			tw := tabwriter.NewWriter(a.out, 0, 4, 2, ' ', 0)
			for _, kv := range [][2]string{
				{"host", s.Host + " (kernel " + s.Kernel + ")"},
				{"containerd", s.Containerd + " at " + s.Address + ", namespace " + s.Namespace},
				{"snapshotter", s.Snapshotter},
				{"criu", s.CRIU},
				{"root", s.Root},
				{"containers", fmt.Sprintf("%d (%d running, %d stopped)", s.Containers, s.Running, s.Stopped)},
				{"memory files", fmt.Sprintf("%d in %d families, %s", s.MemFiles, s.Families, human(s.MemBytes))},
				{"family memory", human(s.FamilyMem) + " (memory files + containers' cgroups)"},
			} {
				fmt.Fprintf(tw, "%s:\t%s\n", kv[0], kv[1])
			}
			return tw.Flush()
		},
	})
}

// snapshotterAnswers tells whether snapshotter name answers through
// containerd. containerd lists a proxy plugin whether or not its process
// runs, and answers "not found" from its own records without asking it, so
// the probe is a call that reaches the snapshotter: a walk (which stats each
// snapshot there) or, when the namespace has none on it, a snapshot prepared
// under a short lease and removed at once.
func (a *app) snapshotterAnswers(name string) error {
	ctx, cancel := context.WithTimeout(a.ctx, 10*time.Second)
	defer cancel()
	sn := a.cd.SnapshotService(name)
	errStop := errors.New("stop")
	seen := false
	err := sn.Walk(ctx, func(context.Context, snapshots.Info) error { seen = true; return errStop })
	if seen || (err != nil && !errors.Is(err, errStop)) {
		if errors.Is(err, errStop) {
			return nil
		}
		return err
	}
	lctx, done, err := a.cd.WithLease(ctx, leases.WithExpiration(time.Minute))
	if err != nil {
		return err
	}
	defer done(context.WithoutCancel(ctx))
	key := "lazyfork-status-probe-" + randomID()
	if _, err := sn.Prepare(lctx, key, ""); err != nil {
		return err
	}
	_ = sn.Remove(lctx, key)
	return nil
}
