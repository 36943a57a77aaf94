#!/usr/bin/env bash
# Fails when the committed generated code differs from what proto/generate.sh makes.
set -euo pipefail
cd "$(dirname "$0")/.."
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
bash proto/generate.sh "$tmp"
stale=0
while IFS= read -r f; do
	rel=${f#"$tmp"/}
	if ! cmp -s "$f" "$rel"; then
		echo "stale: $rel (run make proto)" >&2
		diff -u "$rel" "$f" | head -20 >&2 || true
		stale=1
	fi
done < <(find "$tmp" -name '*.go' | sort)
# generated files with no .proto behind them any more
while IFS= read -r f; do
	[ -e "$tmp/$f" ] || { echo "stale: $f has no source .proto" >&2; stale=1; }
done < <(find proto -name '*.pb.go' | sort)
exit $stale
