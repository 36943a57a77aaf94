// Package lima holds LazyFork's Lima template (lazyfork.yaml): the VM that
// `lazyfork vm start` creates on a Mac (or a Linux host) to run the stack,
// set up with the same make targets as a Linux host, with containerd's
// socket and LazyFork's node API forwarded to the host.
package lima

import _ "embed"

// Template is lazyfork.yaml.
//
//go:embed lazyfork.yaml
var Template []byte

// The forwarded sockets, relative to the instance's directory (Lima's
// {{.Dir}}, "dir" in limactl list --json).
const (
	ContainerdSocket = "sock/containerd.sock"
	APISocket        = "sock/lazyfork-api.sock"
)

// Where the guest serves them to Lima's user (expose-sockets.sh).
const (
	GuestContainerdSocket = "/run/lazyfork-vm/containerd.sock"
	GuestAPISocket        = "/run/lazyfork-vm/lazyfork-api.sock"
)
