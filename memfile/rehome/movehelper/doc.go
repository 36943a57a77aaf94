// Package movehelper is the helper process of a move (shim: the parent on
// its own memory): it seizes every process of a frozen container, moves each
// one's private anonymous memory onto the memory file in place (package
// rehome), installs the madvise guard on what moved (madvguard), and lets go.
//
// It runs as its own small binary, lazyfork-rehome (cmd/lazyfork-rehome),
// started by the shim through containerd's reaper for each move: the shim's
// own binary links containerd and starts in about 7 ms of CPU, inside the
// container's pause; this one in about 2.5 ms. The shim's binary still runs
// it (`containerd-shim-lazyfork-v1-full lazyfork-hook rehome`) where the
// small binary is missing. The request and reply are JSON on stdin and
// stdout; stdin stays open until the shim has moved the helper into the
// container's memory cgroup, and the helper writes nothing before that, so
// the file's pages are charged to the container.
package movehelper
