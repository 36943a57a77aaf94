package main

import (
	"flag"
	"fmt"
	"sort"
)

type treeNode struct {
	*row
	Children []*treeNode `json:"children,omitempty"`
}

func init() {
	var format string
	register(&command{
		name:    "tree",
		args:    "[--format table|json]",
		short:   "show containers as family trees (forks under their parent)",
		example: "  lazyfork tree\n  lazyfork tree --format json",
		flags:   func(fs *flag.FlagSet) { fs.StringVar(&format, "format", "table", "table or json") },
		run: func(a *app, fs *flag.FlagSet, pos, _ []string) error {
			rows, err := a.rows()
			if err != nil {
				return err
			}
			nodes := map[string]*treeNode{}
			for _, r := range rows {
				nodes[r.ID] = &treeNode{row: r}
			}
			var roots []*treeNode
			for _, r := range rows {
				if p := nodes[r.Parent]; r.Parent != "" && p != nil {
					p.Children = append(p.Children, nodes[r.ID])
				} else {
					roots = append(roots, nodes[r.ID])
				}
			}
			sort.SliceStable(roots, func(i, j int) bool { return roots[i].ID < roots[j].ID })
			if format == "json" {
				return writeJSON(a, roots)
			}
			var walk func(n *treeNode, prefix string, last, top bool)
			walk = func(n *treeNode, prefix string, last, top bool) {
				branch, next := "", ""
				if !top {
					branch, next = "├── ", "│   "
					if last {
						branch, next = "└── ", "    "
					}
				}
				label := n.ID
				if n.Name != "" && n.Name != n.ID {
					label += " (" + n.Name + ")"
				}
				if n.Parent != "" && top {
					label += " [parent " + n.Parent + " gone]"
				}
				fmt.Fprintf(a.out, "%s%s%s  %s  %s\n", prefix, branch, label, n.State, human(n.Memory))
				for i, c := range n.Children {
					walk(c, prefix+next, i == len(n.Children)-1, false)
				}
			}
			for _, r := range roots {
				walk(r, "", true, true)
			}
			return nil
		},
	})
}
