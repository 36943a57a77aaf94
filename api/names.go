package api

// RuntimeName is the containerd runtime type every LazyFork container runs
// under: the shim binary containerd starts is containerd-shim-lazyfork-v1.
const RuntimeName = "io.containerd.lazyfork.v1"

// Prefix starts every LazyFork label and annotation key.
const Prefix = "lazyfork.io/"

// Labels LazyFork puts on the containerd containers it makes or reads.
const (
	LabelParent    = Prefix + "parent"     // id of the container forked
	LabelFamily    = Prefix + "family"     // family: the root container and its forks
	LabelSnapshot  = Prefix + "snapshot"   // LazyFork snapshot the task was restored from
	LabelName      = Prefix + "name"       // the user's name for the container
	LabelStopped   = Prefix + "stopped"    // snapshot kept by Stop (image directory)
	LabelRestoreNS = Prefix + "restore-ns" // a fork's task create → running, in ns
	LabelLog       = Prefix + "log"        // file the task's stdout and stderr go to
	// LabelOp marks what one fork call made (its op id), so that Reconcile
	// can find it after the call died.
	LabelOp = Prefix + "op"
	// LabelHook names the host directory of a container's runtime hook
	// socket (hook package).
	LabelHook = Prefix + "hook"
	// LabelShimGroup is a fork's shim group (AnnotationShimGroup), so that
	// a later call's forks of the family find the shims serving it and how
	// many forks each holds.
	LabelShimGroup = Prefix + "shim-group"
	// LabelShimGroupLeader marks the sandbox record (containerd's sandbox
	// store) that joins a fork call's forks to their group's running shim
	// (client/shimjoin.go): the id of the fork whose shim they join.
	LabelShimGroupLeader = Prefix + "shim-group-leader"
)

// Annotations in a container's OCI spec that the shim reads.
const (
	// AnnotationFamily in a fork's spec names its family, for the tools. The
	// shim never takes a container's family from it: a fork's family is its
	// snapshot's, a root starts its own.
	AnnotationFamily = Prefix + "family"
	// AnnotationShimGroup puts forks that carry the same value into one shim
	// process, never their parent's (the client names each group of at most
	// its group size of a family's forks, FAMILY-SNAPSHOT-K of the call that
	// started it), so a dying shim takes down at most one group.
	AnnotationShimGroup = Prefix + "shim-group"
	// AnnotationForkable is a container's (in Kubernetes: a pod's) opt-in to
	// being forked by a pod through AnnotationForkOf; only pods of its own
	// Kubernetes namespace may. "true" allows it.
	AnnotationForkable = Prefix + "forkable"
	// AnnotationMadvise chooses the madvise guard of a container's
	// checkpoints: "refuse" (default), "zero" or "off" (memfile/madvguard).
	AnnotationMadvise = Prefix + "madvise"
	// AnnotationForkOf in a container's spec names a LazyFork snapshot
	// directory, a checkpoint archive containerd wrote, or a running LazyFork
	// container (its id, or NAMESPACE/POD/CONTAINER) the container is
	// restored from instead of started fresh: a fork as a Kubernetes pod.
	AnnotationForkOf = Prefix + "fork-of"
	// AnnotationForkContainer limits AnnotationForkOf, set on a pod (CRI
	// copies allowed pod annotations into every container of the pod), to
	// the container of that name; the pod's sandbox (pause) container is
	// never a fork.
	AnnotationForkContainer = Prefix + "fork-container"
	// AnnotationRehome "false" opts a container out of moving onto its
	// memory files at its checkpoints; RehomeEachSnapshot moves it at
	// every one instead of its first.
	AnnotationRehome = Prefix + "rehome"
	// RehomeEachSnapshot, as AnnotationRehome's value, moves the container
	// at every snapshot, not only at its first (no patched deltas: the
	// shim's LAZYFORK_PATCH_DELTAS=off for one container).
	RehomeEachSnapshot = "each-snapshot"
)

// ValidName reports whether s may name a family, a view or an operation (it
// names files and directories): 1 to 128 of A-Z a-z 0-9 _ . -, the first a
// letter or digit.
func ValidName(s string) bool {
	if len(s) == 0 || len(s) > 128 {
		return false
	}
	for i := 0; i < len(s); i++ {
		c := s[i]
		alnum := 'a' <= c && c <= 'z' || 'A' <= c && c <= 'Z' || '0' <= c && c <= '9'
		if !alnum && (i == 0 || c != '_' && c != '.' && c != '-') {
			return false
		}
	}
	return true
}
