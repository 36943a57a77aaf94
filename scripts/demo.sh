#!/usr/bin/env bash
# demo.sh: LazyFork end to end on a private stack that leaves the system's
# containerd alone. Run after `make deps images build` (make demo does).
#
#   scripts/demo.sh [--keep]
#
# 1. lazyfork setup: a private containerd + lazyfork-snapshotter, all under
#    $LAZYFORK_DEMO_DIR (default /run/lazyfork-demo), logs and pidfiles there too;
# 2. a counter container, its output, a fork of it named twin continuing the count;
# 3. a python container holding 256 MB, forked 10 times, `lazyfork list` showing
#    each fork's memory;
# 4. teardown (unless --keep: then the commands to use and to tear down are printed).
# Exits non-zero on any failure.
set -euo pipefail

KEEP=0
[[ ${1:-} == --keep ]] && KEEP=1
REPO=$(cd "$(dirname "$0")/.." && pwd)
BIN=${LAZYFORK_BIN:-$REPO/bin}
D=${LAZYFORK_DEMO_DIR:-/run/lazyfork-demo}
IMAGES=${LAZYFORK_CACHE:-/var/cache/lazyfork}/images
NS=lazyfork-demo
ADDR=$D/containerd.sock
export PATH=$BIN:/usr/local/sbin:/usr/local/bin:$PATH

lf() { "$BIN/lazyfork" --address "$ADDR" --namespace "$NS" --root "$D/root" --log-dir "$D/logs" "$@"; }
say() { printf '\n\033[1m== %s\033[0m\n' "$*"; }
step() { printf '$ lazyfork %s\n' "$*"; lf "$@"; }

teardown() {
	set +e
	if [[ -S $ADDR ]]; then
		for id in $(lf list --format json 2>/dev/null | sed -n 's/^      "id": "\(.*\)",$/\1/p'); do
			lf delete -f "$id" >/dev/null
		done
	fi
	# Stops the daemons, removes the config, state, logs and the root's tmpfs.
	lf setup --down --purge --config "$D/config.toml" --state "$D/state" --logs "$D/log" >/dev/null
	# What is left (a purge refused while a shim ran): the shims mounted the LazyFork root's tmpfs; it goes once nothing maps it.
	for m in $(awk -v d="$D/" '$2 ~ "^"d {print $2}' /proc/self/mounts | sort -r); do
		umount -l "$m"
	done
	# Memory files are immutable (chattr +i); when the root was on a tmpfs
	# already (/run on most hosts), they are still here: clear the flag.
	rm -rf "$D" 2>/dev/null || { chattr -R -f -i "$D"; rm -rf "$D"; }
}

fail() {
	echo "demo: FAILED: $*" >&2
	for f in "$D"/log/*.log; do
		[[ -f $f ]] && { echo "--- $f (tail)" >&2; tail -n 20 "$f" >&2; }
	done
	exit 1
}

# wait_out NAME REGEX SECONDS: until NAME's output has a line matching REGEX.
wait_out() {
	local end=$((SECONDS + $3))
	until lf attach "$1" --follow=false | grep -Eq "$2"; do
		((SECONDS < end)) || fail "$1 printed no line matching $2 in $3 s"
		sleep 0.2
	done
}

for b in lazyfork lazyfork-snapshotter containerd-shim-lazyfork-v1 containerd-shim-lazyfork-v1-full; do
	[[ -x $BIN/$b ]] || fail "$BIN/$b missing: run make build"
done
for i in busybox python; do
	[[ -f $IMAGES/$i.tar ]] || fail "$IMAGES/$i.tar missing: run make images"
done
command -v containerd >/dev/null || fail "containerd missing: run make deps"
if [[ -e $D ]]; then
	echo "demo: $D exists (an earlier demo?); tearing it down first"
	teardown
fi
((KEEP)) || trap 'teardown' EXIT
start=$SECONDS

say "setup: a private containerd and lazyfork-snapshotter under $D"
mkdir -p "$D"
step setup --config "$D/config.toml" --state "$D/state" --logs "$D/log" || fail setup
step setup --config "$D/config.toml" --state "$D/state" --logs "$D/log" >/dev/null || fail "second setup (must be idempotent)"
for i in busybox python; do
	ctr --address "$ADDR" -n "$NS" images import --no-unpack "$IMAGES/$i.tar" >/dev/null 2>"$D/import.err" || { cat "$D/import.err" >&2; fail "import $i"; }
done
step status || fail status

say "a counter, and its fork 'twin' continuing the count"
step create --name counter localhost/lazyfork/busybox:latest -- \
	sh -c 'i=0; while :; do echo "count $i"; i=$((i+1)); sleep 1; done' || fail create
wait_out counter '^count 3$' 30
step attach counter --follow=false
step fork counter --name twin || fail fork
before=$(lf attach counter --follow=false | tail -n 1)
wait_out twin '^count' 30
sleep 2
echo "(counter was at '$before' when forked)"
step attach twin --follow=false
first=$(lf attach twin --follow=false | head -n 1)
[[ $first =~ ^count\ ([0-9]+)$ ]] || fail "twin's first line: '$first'"
((${BASH_REMATCH[1]} >= 3)) || fail "twin did not continue the count: '$first'"

say "a python container holding 256 MB, forked 10 times"
step create --name py localhost/lazyfork/python:latest -- \
	python3 /opt/lazyfork/workloads/counter.py 256 --interval 0.5 || fail "create py"
wait_out py '^ready' 120
t0=$(date +%s.%N)
step fork py --count 10 >/dev/null || fail "fork py --count 10"
t1=$(date +%s.%N)
printf '(10 forks in %.2f s)\n' "$(echo "$t1 - $t0" | bc 2>/dev/null || echo 0)"
step list || fail list
step tree
step mem
n=$(lf list --format json | grep -c '"state": "running"')
((n == 13)) || fail "want 13 running containers, got $n"

printf '\ndemo: OK in %d s\n' $((SECONDS - start))
if ((KEEP)); then
	cat <<EOT
Kept. Try:
  $BIN/lazyfork --address $ADDR --namespace $NS --root $D/root --log-dir $D/logs attach twin
Tear down with: LAZYFORK_DEMO_DIR=$D $0   (it tears down a previous demo first), or
  $BIN/lazyfork --address $ADDR --root $D/root setup --down --purge --config $D/config.toml --state $D/state --logs $D/log; rm -rf $D
EOT
fi
