// Command nnp stands in for the nonewprivs test image's program: installed
// setuid root, it prints the effective uid it runs with ("Effective uid: 0"
// when the container may gain privileges, the caller's uid under
// no_new_privs). lfh-critest builds it statically into its stand-in.
package main

import (
	"fmt"
	"os"
)

func main() {
	fmt.Printf("Effective uid: %d\n", os.Geteuid())
}
