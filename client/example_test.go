package client_test

import (
	"context"
	"fmt"
	"log"

	"github.com/lazyfork/lazyfork/client"
)

// Fork a running container three times, run a command in a fork, fork that
// fork again, and clean everything up. (Compiled, not run: it needs the real
// stack; integration/sdk_test.go runs the same code against one.)
func Example() {
	ctx := context.Background()
	c, err := client.Connect("/run/containerd/containerd.sock", "default")
	if err != nil {
		log.Fatal(err)
	}
	defer c.Close()

	agent, err := c.Container(ctx, "agent") // a name, an id or a unique id prefix
	if err != nil {
		log.Fatal(err)
	}
	forks, err := agent.Fork(ctx, 3)
	if err != nil {
		log.Fatal(err)
	}
	defer forks.Close() // deletes the three forks

	out, err := forks[0].Exec(ctx, "cat", "/proc/self/cgroup")
	if err != nil {
		log.Fatal(err)
	}
	fmt.Print(out)

	more, err := forks[0].Fork(ctx, 2) // forks fork again
	if err != nil {
		log.Fatal(err)
	}
	defer more.Close()
	fmt.Println(forks.IDs(), more.IDs())
}
