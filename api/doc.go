// Package api is what LazyFork's parts agree on, each defined once: the
// runtime's name, the labels and annotations on containers, the layout of
// LazyFork's root directory, the records the parts write there and in
// snapshot directories, and LazyFork's checkpoint option.
//
// The shim (shim/), the fork client and CLI (client/, cmd/lazyfork), the
// memory-file store (memfile/) and the examples import these definitions
// instead of spelling the strings themselves. The package imports nothing of
// LazyFork's but the generated protos (proto/), so any part may depend on it
// without reaching back up.
package api
