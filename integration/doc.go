// Package integration holds LazyFork's end-to-end tests: each runs a private
// containerd (package harness) with the real runc and CRIU, as root. They run
// with LAZYFORK_INTEGRATION=1 (`make integration`) or CI=true.
package integration
