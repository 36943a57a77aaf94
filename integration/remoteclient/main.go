// Command remoteclient is a Go SDK program for the integration test of
// clients that have only containerd's socket and LazyFork's node API
// (TestClientsWithOnlySockets): it forks PARENT twice, forks the first fork,
// runs a command in that grandchild, reads the families, prints what it saw
// as JSON and deletes what it made. The node API is found where the SDK
// looks by default ($LAZYFORK_API).
//
//	remoteclient CONTAINERD_SOCKET NAMESPACE PARENT
package main

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"strings"
	"time"

	"github.com/containerd/containerd/v2/pkg/namespaces"

	"github.com/lazyfork/lazyfork/client"
)

type report struct {
	Forks    []string `json:"forks"`
	Grand    string   `json:"grand"`
	Exec     string   `json:"exec"`
	Families []string `json:"families"`
	MemBytes int64    `json:"memBytes"`
}

func main() {
	if len(os.Args) != 4 {
		fmt.Fprintln(os.Stderr, "usage: remoteclient CONTAINERD_SOCKET NAMESPACE PARENT")
		os.Exit(2)
	}
	if err := run(os.Args[1], os.Args[2], os.Args[3]); err != nil {
		fmt.Fprintln(os.Stderr, "remoteclient:", err)
		os.Exit(1)
	}
}

func run(address, ns, parent string) error {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	c, err := client.Connect(address, ns)
	if err != nil {
		return err
	}
	defer c.Close()
	ctx = namespaces.WithNamespace(ctx, ns)
	p, err := c.Container(ctx, parent)
	if err != nil {
		return err
	}
	forks, err := p.Fork(ctx, 2)
	if err != nil {
		return err
	}
	defer forks.Close()
	grand, err := forks[0].Fork(ctx, 1)
	if err != nil {
		return err
	}
	defer grand.Close()
	out, err := grand[0].Exec(ctx, "python3", "-c", "print('hello from', 40 + 2)")
	if err != nil {
		return err
	}
	fams, err := c.Families()
	if err != nil {
		return err
	}
	r := report{Forks: forks.IDs(), Grand: grand[0].ID(), Exec: strings.TrimSpace(out)}
	for _, f := range fams {
		r.Families = append(r.Families, f.Name)
		r.MemBytes += f.Bytes
	}
	return json.NewEncoder(os.Stdout).Encode(r)
}
