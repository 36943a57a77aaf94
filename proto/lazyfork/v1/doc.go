// Package lazyforkv1 is the generated ttrpc API of lazyfork-snapshotter
// (proto/lazyfork/v1/*.proto). Regenerate with `make proto`; `make proto-check`
// fails when this code is stale. Dial it with snapshotter/client.
package lazyforkv1
