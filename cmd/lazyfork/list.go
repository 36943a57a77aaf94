package main

import (
	"encoding/json"
	"fmt"
	"sort"
	"strconv"
	"text/tabwriter"

	containerd "github.com/containerd/containerd/v2/client"
	"github.com/containerd/errdefs"
	"github.com/spf13/pflag"

	"github.com/lazyfork/lazyfork/api"
)

// row is one container as list, tree and stats show it.
type row struct {
	ID       string `json:"id"`
	Name     string `json:"name,omitempty"`
	State    string `json:"state"`
	Parent   string `json:"parent,omitempty"`
	Family   string `json:"family,omitempty"`
	Depth    int    `json:"depth"`
	PID      uint32 `json:"pid,omitempty"`
	Procs    int    `json:"procs"`
	Memory   int64  `json:"memoryBytes"` // the container's memory cgroup usage
	Image    string `json:"image"`
	Runtime  string `json:"runtime"`
	Snapshot string `json:"snapshot,omitempty"` // kept by stop
	Log      string `json:"log,omitempty"`
	// MemFile: the container's process maps LazyFork memory files (a fork,
	// or a parent that moved onto its snapshot's memory); MemFileBytes and
	// MemFileMappings are the size and count of those mappings of its init
	// process (/proc/PID/maps).
	MemFile         bool  `json:"memFile"`
	MemFileBytes    int64 `json:"memFileBytes"`
	MemFileMappings int   `json:"memFileMappings"`
	cgroup          string
	// rssAnon and rssShared of its init process (stats shows them).
	rssAnon, rssShared int64
}

func init() {
	var format string
	var quiet bool
	register(&command{
		name:  "list",
		args:  "[-q] [--format table|json|TEMPLATE]",
		short: "list containers: id, name, state, parent, depth, pid, procs, memory, and a total",
		example: `  lazyfork list
  lazyfork list -q                                  # ids only
  lazyfork list --format json | jq '.containers[].memoryBytes'
  lazyfork list --format '{{.ID}} {{.State}}'       # a Go template per container
  lazyfork list --format '{{json .}}'               # one JSON object a line
  lazyfork list --format 'table {{.ID}}\t{{.Parent}}\t{{human .Memory}}'`,
		flags: func(fs *pflag.FlagSet) {
			addFormat(fs, &format)
			fs.BoolVarP(&quiet, "quiet", "q", false, "print the ids only")
		},
		run: func(a *app, fs *pflag.FlagSet, pos, _ []string) error {
			o, err := listingFormat(pos, format)
			if err != nil {
				return err
			}
			rows, err := a.rows()
			if err != nil {
				return err
			}
			if quiet {
				for _, r := range rows {
					fmt.Fprintln(a.out, r.ID)
				}
				return nil
			}
			var total int64
			procs := 0
			for _, r := range rows {
				total += r.Memory
				procs += r.Procs
			}
			switch o.kind {
			case "json":
				return writeJSON(a, map[string]any{"containers": rows, "total": map[string]any{"containers": len(rows), "procs": procs, "memoryBytes": total}})
			case "template":
				items := make([]any, len(rows))
				for i, r := range rows {
					items[i] = r
				}
				return o.template(a.out, items...)
			}
			tw := tabwriter.NewWriter(a.out, 0, 4, 2, ' ', 0)
			head := "ID\tNAME\tSTATE\tPARENT\tDEPTH\tPID\tPROCS\tMEMORY\tMEMFILE"
			if a.g.allRuntimes {
				head += "\tRUNTIME"
			}
			fmt.Fprintln(tw, head)
			for _, r := range rows {
				pid := "-"
				if r.PID != 0 {
					pid = strconv.Itoa(int(r.PID))
				}
				fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%d\t%s\t%d\t%s\t%s", r.ID, orDash(r.Name), r.State, orDash(r.Parent), r.Depth, pid, r.Procs, human(r.Memory), r.memFileCell())
				if a.g.allRuntimes {
					fmt.Fprintf(tw, "\t%s", r.Runtime)
				}
				fmt.Fprintln(tw)
			}
			fmt.Fprintf(tw, "TOTAL\t%d containers\t\t\t\t\t%d\t%s\n", len(rows), procs, human(total))
			return tw.Flush()
		},
	})
}

func writeJSON(a *app, v any) error {
	enc := json.NewEncoder(a.out)
	enc.SetIndent("", "  ")
	return enc.Encode(v)
}

func human(b int64) string {
	switch {
	case b <= 0:
		return "-"
	case b >= 1<<30:
		return fmt.Sprintf("%.1f GiB", float64(b)/(1<<30))
	case b >= 1<<20:
		return fmt.Sprintf("%.1f MiB", float64(b)/(1<<20))
	default:
		return fmt.Sprintf("%.0f KiB", float64(b)/(1<<10))
	}
}

// rows describes every LazyFork container in the namespace (every container
// with --all-runtimes), sorted by family, depth, id.
func (a *app) rows() ([]*row, error) {
	ctrs, err := a.cd.Containers(a.ctx)
	if err != nil {
		return nil, err
	}
	var rows []*row
	byID := map[string]*row{}
	for _, ctr := range ctrs {
		if !a.g.allRuntimes {
			if info, err := ctr.Info(a.ctx, containerd.WithoutRefreshedMetadata); err != nil || info.Runtime.Name != api.RuntimeName {
				continue // another runtime's: not ours to show (--all-runtimes)
			}
		}
		r, err := a.row(ctr)
		if err != nil {
			if errdefs.IsNotFound(err) {
				continue // deleted meanwhile
			}
			return nil, err
		}
		rows = append(rows, r)
		byID[r.ID] = r
	}
	for _, r := range rows {
		seen := map[string]bool{r.ID: true}
		for p := r.Parent; p != ""; {
			r.Depth++
			pr := byID[p]
			if pr == nil || seen[p] {
				break
			}
			seen[p] = true
			p = pr.Parent
		}
	}
	sort.Slice(rows, func(i, j int) bool {
		if rows[i].Family != rows[j].Family {
			return rows[i].Family < rows[j].Family
		}
		if rows[i].Depth != rows[j].Depth {
			return rows[i].Depth < rows[j].Depth
		}
		return rows[i].ID < rows[j].ID
	})
	return rows, nil
}

func (a *app) row(ctr containerd.Container) (*row, error) {
	info, err := ctr.Info(a.ctx, containerd.WithoutRefreshedMetadata)
	if err != nil {
		return nil, err
	}
	r := &row{
		ID: info.ID, Name: info.Labels[api.LabelName], Parent: info.Labels[api.LabelParent],
		Family: info.Labels[api.LabelFamily], Image: info.Image, Runtime: info.Runtime.Name,
		Snapshot: info.Labels[api.LabelStopped], Log: info.Labels[api.LabelLog],
	}
	if r.Family == "" {
		r.Family = info.ID
	}
	if spec, err := ctr.Spec(a.ctx); err == nil && spec.Linux != nil {
		r.cgroup = spec.Linux.CgroupsPath
	}
	task, err := ctr.Task(a.ctx, nil)
	if err != nil {
		if !errdefs.IsNotFound(err) {
			return nil, err
		}
		r.State = "exited"
		if r.Snapshot != "" {
			r.State = "stopped"
		}
		return r, nil
	}
	st, err := task.Status(a.ctx)
	if err != nil {
		r.State = "unknown"
		return r, nil
	}
	r.State = string(st.Status)
	if st.Status == containerd.Stopped {
		r.State = "exited"
		return r, nil
	}
	r.PID = task.Pid()
	if pids, err := task.Pids(a.ctx); err == nil {
		r.Procs = len(pids)
	}
	// The node reads the process's maps and its cgroup.
	u, err := a.lf.Node().Usage(a.ctx, r.PID, r.cgroup)
	if err != nil {
		return nil, fmt.Errorf("memory of %s: %w", r.ID, err)
	}
	r.Memory = u.Memory
	r.MemFile, r.MemFileBytes, r.MemFileMappings = u.MemFileMappings > 0, u.MemFileBytes, u.MemFileMappings
	r.rssAnon, r.rssShared = u.RssAnon, u.RssShared
	return r, nil
}

// memFileCell is the MEMFILE column: "yes 64.0 MiB", "no", or "-" when the
// container has no running process (or its maps could not be read).
func (r *row) memFileCell() string {
	switch {
	case r.MemFile:
		return "yes " + human(r.MemFileBytes)
	case r.PID != 0:
		return "no"
	}
	return "-"
}
