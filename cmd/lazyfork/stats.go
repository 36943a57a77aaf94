package main

import (
	"encoding/csv"
	"fmt"
	"strconv"
	"text/tabwriter"
	"time"

	"github.com/spf13/pflag"

	"github.com/lazyfork/lazyfork/api"
)

type stats struct {
	ID            string  `json:"id"`
	Name          string  `json:"name,omitempty"`
	State         string  `json:"state"`
	Memory        int64   `json:"memoryBytes"`    // cgroup usage
	RssAnon       int64   `json:"rssAnonBytes"`   // init process's private anonymous memory
	RssShared     int64   `json:"rssSharedBytes"` // its pages shared through the memory files
	Snapshot      string  `json:"snapshot,omitempty"`
	SnapshotBytes int64   `json:"snapshotBytes"`
	SnapshotPages uint64  `json:"snapshotPages"`
	RestoreSec    float64 `json:"restoreSeconds"` // task create → running, for a fork
	// MemFile: runs on memory files (see row); the size and count of its
	// init process's mappings of them.
	MemFile         bool  `json:"memFile"`
	MemFileBytes    int64 `json:"memFileBytes"`
	MemFileMappings int   `json:"memFileMappings"`
}

func init() {
	var format string
	var asCSV, header bool
	register(&command{
		name:  "stats",
		args:  "NAME [--format table|json|TEMPLATE] [--csv [--header]]",
		short: "memory, snapshot size and pages, restore timing of one container",
		example: `  lazyfork stats twin
  lazyfork stats twin --csv --header > stats.csv; lazyfork stats fork2 --csv >> stats.csv
  lazyfork stats twin --format '{{.RssAnon}}'`,
		flags: func(fs *pflag.FlagSet) {
			addFormat(fs, &format)
			fs.BoolVar(&asCSV, "csv", false, "one CSV row")
			fs.BoolVar(&header, "header", false, "with --csv: a header line first")
		},
		run: func(a *app, fs *pflag.FlagSet, pos, _ []string) error {
			o, err := parseFormat(format)
			if err != nil {
				return err
			}
			ctr, err := a.loadOne(pos)
			if err != nil {
				return err
			}
			r, err := a.row(ctr)
			if err != nil {
				return err
			}
			labels, _ := ctr.Labels(a.ctx)
			s := stats{ID: r.ID, Name: r.Name, State: r.State, Memory: r.Memory,
				MemFile: r.MemFile, MemFileBytes: r.MemFileBytes, MemFileMappings: r.MemFileMappings}
			s.RssAnon, s.RssShared = r.rssAnon, r.rssShared
			s.Snapshot = labels[api.LabelStopped]
			if s.Snapshot == "" {
				s.Snapshot = labels[api.LabelSnapshot]
			}
			if s.Snapshot != "" {
				if info, err := a.lf.Node().Snapshot(a.ctx, s.Snapshot); err == nil {
					s.SnapshotPages = info.Pages
					s.SnapshotBytes = info.Bytes
				} else {
					s.Snapshot += " (removed)"
				}
			}
			if ns, err := strconv.ParseInt(labels[api.LabelRestoreNS], 10, 64); err == nil {
				s.RestoreSec = time.Duration(ns).Seconds()
			}
			switch {
			case asCSV:
				w := csv.NewWriter(a.out)
				if header {
					_ = w.Write([]string{"id", "name", "state", "memory_bytes", "rss_anon_bytes", "rss_shared_bytes", "snapshot_bytes", "snapshot_pages", "restore_seconds",
						"memfile", "memfile_bytes", "memfile_mappings"})
				}
				_ = w.Write([]string{s.ID, s.Name, s.State, itoa(s.Memory), itoa(s.RssAnon), itoa(s.RssShared), itoa(s.SnapshotBytes),
					strconv.FormatUint(s.SnapshotPages, 10), strconv.FormatFloat(s.RestoreSec, 'f', 4, 64),
					strconv.FormatBool(s.MemFile), itoa(s.MemFileBytes), strconv.Itoa(s.MemFileMappings)})
				w.Flush()
				return w.Error()
			case o.kind == "json":
				return writeJSON(a, s)
			case o.kind == "template":
				return o.template(a.out, s)
			}
			tw := tabwriter.NewWriter(a.out, 0, 4, 2, ' ', 0)
			fmt.Fprintf(tw, "id:\t%s\nname:\t%s\nstate:\t%s\n", s.ID, orDash(s.Name), s.State)
			fmt.Fprintf(tw, "memory (cgroup):\t%s\nrss anon:\t%s\nrss shared (memory files):\t%s\n", human(s.Memory), human(s.RssAnon), human(s.RssShared))
			mf := r.memFileCell()
			if s.MemFile {
				mf = fmt.Sprintf("%s mapped (%d mappings)", mf, s.MemFileMappings)
			}
			fmt.Fprintf(tw, "memory files:\t%s\n", mf)
			fmt.Fprintf(tw, "snapshot:\t%s\nsnapshot size:\t%s (%d pages in the image)\n", orDash(s.Snapshot), human(s.SnapshotBytes), s.SnapshotPages)
			rt := "-"
			if s.RestoreSec > 0 {
				rt = fmt.Sprintf("%.3f s", s.RestoreSec)
			}
			fmt.Fprintf(tw, "restore:\t%s\n", rt)
			return tw.Flush()
		},
	})
}

func itoa(v int64) string { return strconv.FormatInt(v, 10) }
