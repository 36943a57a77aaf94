#!/usr/bin/env bash
# expose-sockets.sh USER: in LazyFork's Lima VM, serve containerd's socket and
# LazyFork's node API (root's, mode 0600 under /run/containerd and /run/lazyfork)
# to USER under /run/lazyfork-vm, where Lima forwards them to the host (Lima's
# socket forwarding runs as its user). Each is a systemd socket unit and
# systemd-socket-proxyd, so they survive restarts of containerd and the
# snapshotter. Idempotent.
set -euo pipefail
user=${1:?usage: expose-sockets.sh USER}
proxyd=/lib/systemd/systemd-socket-proxyd
[ -x "$proxyd" ] || proxyd=/usr/lib/systemd/systemd-socket-proxyd
unit() { # unit NAME LISTEN TARGET AFTER
	cat >/etc/systemd/system/lazyfork-vm-$1.socket <<UNIT
[Unit]
Description=LazyFork VM: $3 for the host (Lima forwards $2)

[Socket]
ListenStream=$2
SocketUser=$user
SocketMode=0600
DirectoryMode=0755

[Install]
WantedBy=sockets.target
UNIT
	cat >/etc/systemd/system/lazyfork-vm-$1.service <<UNIT
[Unit]
Description=LazyFork VM: proxy to $3
Requires=lazyfork-vm-$1.socket
After=$4

[Service]
ExecStart=$proxyd $3
UNIT
}
unit containerd /run/lazyfork-vm/containerd.sock /run/containerd/containerd.sock containerd.service
unit api /run/lazyfork-vm/lazyfork-api.sock /run/lazyfork/snapshotter.sock.ttrpc lazyfork-snapshotter.service
systemctl daemon-reload
systemctl enable --now lazyfork-vm-containerd.socket lazyfork-vm-api.socket
