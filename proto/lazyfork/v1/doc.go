// Package lazyforkv1 is the generated ttrpc API of lazyfork-snapshotter
// (proto/lazyfork/v1/*.proto): the Snapshotter service (dial it with
// snapshotter/client) and the Node service, what clients need of LazyFork's
// root (package node serves and dials it). Regenerate with `make proto`;
// `make proto-check` fails when this code is stale.
package lazyforkv1
