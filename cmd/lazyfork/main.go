// Command lazyfork forks running containers (a minimal CLI for now):
//
//	lazyfork [--address SOCK] [--namespace NS] [--root DIR] fork NAME [-n N]
//	lazyfork [--root DIR] mem
//
// fork prints the ids of the new containers, one a line; mem lists each
// family's memory files, what pins them and the memory cgroup they are
// charged to.
package main

import (
	"context"
	"flag"
	"fmt"
	"os"

	containerd "github.com/containerd/containerd/v2/client"
	"github.com/containerd/containerd/v2/pkg/namespaces"

	"github.com/lazyfork/lazyfork/client"
)

func main() {
	if err := run(os.Args[1:]); err != nil {
		fmt.Fprintln(os.Stderr, "lazyfork:", err)
		os.Exit(1)
	}
}

func usage() {
	fmt.Fprintln(os.Stderr, "usage: lazyfork [--address SOCK] [--namespace NS] [--root DIR] fork NAME [-n N]")
	fmt.Fprintln(os.Stderr, "       lazyfork [--root DIR] mem")
}

func run(args []string) error {
	g := flag.NewFlagSet("lazyfork", flag.ContinueOnError)
	g.Usage = usage
	address := g.String("address", envOr("CONTAINERD_ADDRESS", "/run/containerd/containerd.sock"), "containerd socket")
	ns := g.String("namespace", envOr("CONTAINERD_NAMESPACE", "default"), "containerd namespace")
	root := g.String("root", envOr("LAZYFORK_ROOT", client.DefaultRoot), "LazyFork root (the shim's LAZYFORK_ROOT)")
	if err := g.Parse(args); err != nil {
		return err
	}
	rest := g.Args()
	if len(rest) == 1 && rest[0] == "mem" {
		return mem(client.New(nil, client.WithRoot(*root)))
	}
	if len(rest) == 0 || rest[0] != "fork" {
		usage()
		return fmt.Errorf("unknown command %q", rest)
	}
	f := flag.NewFlagSet("fork", flag.ContinueOnError)
	f.Usage = usage
	n := f.Int("n", 1, "number of forks")
	// Accept `fork NAME -n N` as well as `fork -n N NAME`.
	var name string
	fargs := rest[1:]
	if len(fargs) > 0 && len(fargs[0]) > 0 && fargs[0][0] != '-' {
		name, fargs = fargs[0], fargs[1:]
	}
	if err := f.Parse(fargs); err != nil {
		return err
	}
	if name == "" && f.NArg() == 1 {
		name = f.Arg(0)
	} else if f.NArg() != 0 || name == "" {
		usage()
		return fmt.Errorf("fork needs exactly one container name")
	}

	cd, err := containerd.New(*address)
	if err != nil {
		return err
	}
	defer cd.Close()
	ctx := namespaces.WithNamespace(context.Background(), *ns)
	res, err := client.New(cd, client.WithRoot(*root)).Fork(ctx, name, *n)
	if err != nil {
		return err
	}
	for _, id := range res.IDs() {
		fmt.Println(id)
	}
	return nil
}

func envOr(k, def string) string {
	if v := os.Getenv(k); v != "" {
		return v
	}
	return def
}

func mem(c *client.Client) error {
	fams, err := c.Families()
	if err != nil {
		return err
	}
	fmt.Printf("%-30s %6s %12s %8s  %s\n", "FAMILY", "FILES", "BYTES", "HOLDERS", "CHARGED TO (MEMORY CGROUP)")
	for _, f := range fams {
		cg := f.MemoryCgroup
		if cg == "" {
			cg = "-"
		}
		fmt.Printf("%-30s %6d %12d %8d  %s\n", f.Name, len(f.Files), f.Bytes, len(f.Holders), cg)
	}
	return nil
}
