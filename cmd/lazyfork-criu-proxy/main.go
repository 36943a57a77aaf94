// Command lazyfork-criu-proxy is installed as `criu` in a directory of its own
// (criu-proxy/ beside the shim binaries) that the LazyFork shim puts first on
// the PATH of its runc calls: it answers runc's CRIU version checks from a
// cache of the real CRIU's answer and executes the real CRIU for everything
// else (internal/criuproxy).
package main

import "github.com/lazyfork/lazyfork/internal/criuproxy"

func main() { criuproxy.Main() }
