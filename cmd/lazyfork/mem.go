package main

import (
	"flag"
	"fmt"
	"sort"
)

func init() {
	register(&command{
		name:    "mem",
		args:    "",
		short:   "list each family's memory files, what pins them and the memory cgroup they are charged to",
		example: "  lazyfork mem",
		noConn:  true,
		run: func(a *app, fs *flag.FlagSet, pos, _ []string) error {
			fams, err := a.lf.Families()
			if err != nil {
				return err
			}
			fmt.Fprintf(a.out, "%-30s %6s %12s %8s  %s\n", "FAMILY", "FILES", "BYTES", "HOLDERS", "CHARGED TO (MEMORY CGROUP)")
			for _, f := range fams {
				fmt.Fprintf(a.out, "%-30s %6d %12d %8d  %s\n", f.Name, len(f.Files), f.Bytes, len(f.Holders), orDash(f.MemoryCgroup))
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
					fmt.Fprintf(a.out, "  %-28s %6s %12d %8s  %s\n", file, "", f.Files[file], "", f.ChargedTo[file])
				}
			}
			return nil
		},
	})
}
