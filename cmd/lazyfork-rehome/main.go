// Command lazyfork-rehome is the helper process the LazyFork shim runs for
// each move of a container onto its memory file (memfile/rehome/movehelper):
// a request on stdin, the reply on stdout. It is not meant to be run by hand.
package main

import (
	"fmt"
	"os"

	"github.com/lazyfork/lazyfork/memfile/rehome/movehelper"
)

func main() {
	if len(os.Args) != 1 {
		fmt.Fprintln(os.Stderr, "lazyfork-rehome: the LazyFork shim's helper for a move onto a memory file; it takes a JSON request on stdin and no arguments")
		os.Exit(2)
	}
	if err := movehelper.Run(os.Stdin, os.Stdout); err != nil {
		fmt.Fprintf(os.Stderr, "lazyfork rehome: %v\n", err)
		os.Exit(1)
	}
}
