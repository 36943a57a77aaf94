// Command containerd-shim-lazyfork-v1-full is the shim of the runtime
// io.containerd.lazyfork.v1: containerd's runc shim with LazyFork's layer.
// containerd runs the small front, containerd-shim-lazyfork-v1, which answers
// a `start` whose shim already runs and executes this binary, found beside
// it, for everything else; the shim daemon, the OCI hook (first argument
// "lazyfork-hook") and the madvise supervisor are this binary re-executed.
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
