// Command lfh-reap tears down what a crashed test's private containerd left:
// `go run ./integration/harness/cmd/lfh-reap /tmp/lfh-ID-N ...` (see harness.Reap).
package main

import (
	"context"
	"fmt"
	"os"

	"github.com/lazyfork/lazyfork/integration/harness"
)

func main() {
	if len(os.Args) < 2 {
		fmt.Fprintln(os.Stderr, "usage: lfh-reap /tmp/lfh-ID-N ...")
		os.Exit(2)
	}
	rc := 0
	for _, dir := range os.Args[1:] {
		if err := harness.Reap(context.Background(), dir); err != nil {
			fmt.Fprintf(os.Stderr, "lfh-reap %s: %v\n", dir, err)
			rc = 1
			continue
		}
		fmt.Printf("reaped %s\n", dir)
	}
	os.Exit(rc)
}
