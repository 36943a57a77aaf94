// Command containerd-shim-lazyfork-v1 is the containerd shim of the runtime
// io.containerd.lazyfork.v1. Invoked with "lazyfork-hook" as first argument it
// is LazyFork's OCI hook instead.
package main

import (
	"context"
	"os"

	"github.com/containerd/containerd/v2/pkg/shim"

	"github.com/lazyfork/lazyfork/api"
	"github.com/lazyfork/lazyfork/memfile/madvguard"
	lfshim "github.com/lazyfork/lazyfork/shim"
	_ "github.com/lazyfork/lazyfork/shim/plugin"
)

func main() {
	// A madvise supervisor helper (zero mode) is this binary re-executed.
	madvguard.MaybeServe()
	if len(os.Args) > 1 && os.Args[1] == lfshim.HookArg {
		os.Exit(lfshim.RunHook(os.Args[2:]))
	}
	shim.RunShim(context.Background(), lfshim.NewManager(api.RuntimeName))
}
