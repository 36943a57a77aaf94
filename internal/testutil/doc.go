// Package testutil gates tests by the tier they belong to.
//
// # Tiers
//
// Plain `go test ./...` runs everywhere, without root. Tests that need root, CRIU,
// containerd or runc call one of the Requires* helpers first. Those tests run when
// LAZYFORK_INTEGRATION=1 (set by `make integration`) or CI=true, and are skipped
// otherwise. Under CI=true a missing piece of the stack is a failure, never a skip,
// so a green CI always means the real path ran.
package testutil
