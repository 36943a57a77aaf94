package main

import (
	"fmt"
	"sort"
	"text/tabwriter"

	"github.com/spf13/pflag"

	"github.com/lazyfork/lazyfork/client"
)

// memFamily is one family as mem shows it.
type memFamily struct {
	Name  string           `json:"name"`
	Files map[string]int64 `json:"files"` // memory file → bytes on the tmpfs
	Bytes int64            `json:"bytes"`
	// Holders: the containers and snapshots that pin files, with the files.
	Holders      map[string][]string `json:"holders"`
	MemoryCgroup string              `json:"memoryCgroup,omitempty"` // the family's shim's
	ChargedTo    map[string]string   `json:"chargedTo,omitempty"`    // memory file → memory cgroup
}

func init() {
	var format string
	register(&command{
		name:  "mem",
		args:  "[--format table|json|TEMPLATE]",
		short: "list each family's memory files, what pins them and the memory cgroup they are charged to",
		example: `  lazyfork mem
  lazyfork mem --format json
  lazyfork mem --format '{{.Name}} {{human .Bytes}}'`,
		noConn: true,
		flags:  func(fs *pflag.FlagSet) { addFormat(fs, &format) },
		run: func(a *app, fs *pflag.FlagSet, pos, _ []string) error {
			o, err := listingFormat(pos, format)
			if err != nil {
				return err
			}
			fams, err := a.families()
			if err != nil {
				return err
			}
			out := make([]*memFamily, len(fams))
			items := make([]any, len(fams))
			for i, f := range fams {
				out[i] = &memFamily{Name: f.Name, Files: f.Files, Bytes: f.Bytes, Holders: f.Holders,
					MemoryCgroup: f.MemoryCgroup, ChargedTo: f.ChargedTo}
				items[i] = out[i]
			}
			switch o.kind {
			case "json":
				return writeJSON(a, out)
			case "template":
				return o.template(a.out, items...)
			}
			tw := tabwriter.NewWriter(a.out, 0, 4, 2, ' ', 0)
			fmt.Fprintln(tw, "FAMILY\tFILES\tSIZE\tHOLDERS\tCHARGED TO (MEMORY CGROUP)")
			for _, f := range out {
				fmt.Fprintf(tw, "%s\t%d\t%s\t%d\t%s\n", f.Name, len(f.Files), human(f.Bytes), len(f.Holders), orDash(f.MemoryCgroup))
				// Files charged elsewhere than the family's shim (a
				// container moved onto its own file) are listed apart.
				names := make([]string, 0, len(f.ChargedTo))
				for file, cg := range f.ChargedTo {
					if cg != f.MemoryCgroup {
						names = append(names, file)
					}
				}
				sort.Strings(names)
				for _, file := range names {
					fmt.Fprintf(tw, "  %s\t\t%s\t\t%s\n", file, human(f.Files[file]), f.ChargedTo[file])
				}
			}
			return tw.Flush()
		},
	})
}

// families are the families that have memory files on this host (a family
// whose files are all gone is not shown).
func (a *app) families() ([]client.FamilyInfo, error) {
	fams, err := a.lf.Families()
	if err != nil {
		return nil, err
	}
	keep := fams[:0]
	for _, f := range fams {
		if len(f.Files) > 0 {
			keep = append(keep, f)
		}
	}
	return keep, nil
}
