package client

import (
	"io"

	"github.com/containerd/containerd/v2/pkg/cio"

	"github.com/lazyfork/lazyfork/node"
)

// stdio is the cio.Creator of a process the client runs with these streams.
// Through the node API the node makes the fifos and relays them
// (node.Remote.IO): containerd's shim opens fifos by path, and a client on
// another host (a Mac driving a Lima VM) or in another mount namespace
// shares no fifo directory with it. On the node's files (WithRoot) they
// are local fifos, as containerd's clients make them.
func (c *Client) stdio(stdin io.Reader, stdout, stderr io.Writer, tty bool) cio.Creator {
	if r, ok := c.node.(node.StdioRelay); ok {
		return r.IO(stdin, stdout, stderr, tty)
	}
	opts := []cio.Opt{cio.WithStreams(stdin, stdout, stderr)}
	if tty {
		opts = append(opts, cio.WithTerminal)
	}
	return cio.NewCreator(opts...)
}
