#!/usr/bin/env bash
# Regenerates the Go code of proto/**/*.proto (protoc-gen-go + protoc-gen-go-ttrpc).
# Usage: bash proto/generate.sh [OUTDIR]   (OUTDIR defaults to the repository root)
# The plugins are installed at pinned versions into $(go env GOPATH)/bin when missing.
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-.}
GO=${GO:-go}
bin=$($GO env GOPATH)/bin
pbver=$($GO list -m -f '{{.Version}}' google.golang.org/protobuf)
ttrpcver=v1.2.9

command -v protoc >/dev/null || { echo "protoc missing: apt-get install protobuf-compiler" >&2; exit 1; }
if ! "$bin/protoc-gen-go" --version 2>/dev/null | grep -qx "protoc-gen-go $pbver"; then
	GOFLAGS=-mod=mod $GO install "google.golang.org/protobuf/cmd/protoc-gen-go@$pbver"
fi
if [ ! -x "$bin/protoc-gen-go-ttrpc" ] || [ "$(cat "$bin/.protoc-gen-go-ttrpc.version" 2>/dev/null)" != "$ttrpcver" ]; then
	$GO install "github.com/containerd/ttrpc/cmd/protoc-gen-go-ttrpc@$ttrpcver"
	echo "$ttrpcver" > "$bin/.protoc-gen-go-ttrpc.version"
fi

mapfile -t protos < <(find proto -name '*.proto' | sort)
PATH="$bin:$PATH" protoc -I proto \
	--go_out="$out" --go_opt=module=github.com/lazyfork/lazyfork \
	--go-ttrpc_out="$out" --go-ttrpc_opt=module=github.com/lazyfork/lazyfork \
	"${protos[@]}"
