#!/usr/bin/env bash
# critest.sh builds the Kubernetes CRI validation suite, critest, from its Go
# module (sigs.k8s.io/cri-tools, fetched through the Go module proxy) into
# bin/critest, unless bin/critest is already that version. critest is a ginkgo
# test binary: cri-tools builds it with `go test -c ./cmd/critest`, and so does
# this script, in a writable copy of the module.
#
# Usage: scripts/critest.sh [OUT]   (default OUT: bin/critest)
set -euo pipefail

VERSION=${CRITOOLS_VERSION:-v1.37.0}
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
OUT=${1:-$REPO/bin/critest}
STAMP=$OUT.version

if [ -x "$OUT" ] && [ "$(cat "$STAMP" 2>/dev/null)" = "$VERSION" ]; then
	exit 0
fi
cd "$REPO"
dir=$(go mod download -json "sigs.k8s.io/cri-tools@$VERSION" | sed -n 's/^\s*"Dir": "\(.*\)",$/\1/p')
[ -n "$dir" ] && [ -d "$dir" ] || {
	echo "critest.sh: cannot download sigs.k8s.io/cri-tools@$VERSION" >&2
	exit 1
}
work=$(mktemp -d /tmp/cri-tools-XXXXXX)
trap 'rm -rf "$work"' EXIT
cp -r "$dir/." "$work/"
chmod -R u+w "$work"
mkdir -p "$(dirname "$OUT")"
echo "critest.sh: building critest $VERSION (a minute or two the first time)" >&2
(cd "$work" && GOFLAGS=-mod=mod CGO_ENABLED=0 go test -c -o "$OUT.tmp" ./cmd/critest)
mv "$OUT.tmp" "$OUT"
echo "$VERSION" >"$STAMP"
