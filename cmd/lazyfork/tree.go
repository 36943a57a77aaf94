package main

import (
	"fmt"
	"sort"

	"github.com/spf13/pflag"
)

type treeNode struct {
	*row
	Children []*treeNode `json:"children,omitempty"`
}

func init() {
	var format string
	register(&command{
		name:  "tree",
		args:  "[--format table|json|TEMPLATE]",
		short: "show containers as family trees (forks under their parent)",
		example: `  lazyfork tree
  lazyfork tree --format json                       # the trees, children nested
  lazyfork tree --format '{{.Depth}} {{.ID}}'       # a Go template per container, parents first`,
		flags: func(fs *pflag.FlagSet) { addFormat(fs, &format) },
		run: func(a *app, fs *pflag.FlagSet, pos, _ []string) error {
			o, err := listingFormat(pos, format)
			if err != nil {
				return err
			}
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
			switch o.kind {
			case "json":
				return writeJSON(a, roots)
			case "template":
				var items []any
				var flat func(n *treeNode)
				flat = func(n *treeNode) {
					items = append(items, n.row)
					for _, c := range n.Children {
						flat(c)
					}
				}
				for _, r := range roots {
					flat(r)
				}
				return o.template(a.out, items...)
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
