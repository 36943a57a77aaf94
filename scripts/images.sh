#!/usr/bin/env bash
# images.sh builds LazyFork's test images without a registry and caches them as OCI
# archives that `ctr images import` (and the Go client's Import) accept:
#
#   localhost/lazyfork/busybox:latest  busybox-static from Debian, one layer
#   localhost/lazyfork/python:latest   debootstrap minbase + python3-minimal (bookworm),
#                                      trimmed of docs/locales/apt lists; a small layer
#                                      adds SQLite (libsqlite3-0 and python's sqlite3
#                                      module from libpython3.11-stdlib); another holds
#                                      integration/workloads/*.py at
#                                      /opt/lazyfork/workloads/, so editing a workload
#                                      re-packs only that layer.
#   localhost/lazyfork/node:latest     debootstrap minbase + nodejs (bookworm), trimmed.
#   registry.k8s.io/pause:3.10.2       CRI's sandbox image (containerd's default
#                                      pinned_images.sandbox), which cannot be pulled
#                                      here: a static C program (gcc -static) that
#                                      sleeps, reaps orphans and exits on SIGINT/SIGTERM.
#
# Usage: scripts/images.sh [--print-path] [busybox|python|node|pause|all]...   (default: all)
#
# Archives go to ${LAZYFORK_CACHE:-/var/cache/lazyfork}/images/<name>.tar. Each one is
# rebuilt only when its recipe (*_RECIPE below, the workloads) changed; a cached re-run
# takes a fraction of a second. Every step prints its time on stderr; --print-path
# prints the archive paths on stdout. Concurrent runs serialise on a lock file.
# Needs root (debootstrap), apt access to a Debian mirror, and: apt-get, dpkg,
# debootstrap, tar, gzip, sha256sum, flock; for pause: gcc and a static libc (libc6-dev).
set -euo pipefail

# Bump a recipe number when its recipe below changes: forces a rebuild of that image.
BUSYBOX_RECIPE=2
PYTHON_RECIPE=1
PAUSE_RECIPE=1
NODE_RECIPE=1
SQLITE_RECIPE=1
PAUSE_REF=registry.k8s.io/pause:3.10.2
CACHE=${LAZYFORK_CACHE:-/var/cache/lazyfork}
IMAGES=$CACHE/images
MIRROR=${LAZYFORK_DEBIAN_MIRROR:-http://deb.debian.org/debian}
SUITE=bookworm
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
WORKLOADS=$REPO/integration/workloads

print_path=0
names=()
for a in "$@"; do
	case $a in
	--print-path) print_path=1 ;;
	busybox | python | node | pause) names+=("$a") ;;
	all) names+=(busybox python node pause) ;;
	-h | --help)
		sed -n '2,26p' "$0"
		exit 0
		;;
	*)
		echo "images.sh: unknown argument '$a' (want busybox, python, node, pause, all or --print-path)" >&2
		exit 2
		;;
	esac
done
[ ${#names[@]} -gt 0 ] || names=(busybox python node pause)

die() { # the EXIT trap then names the step that failed
	echo "images.sh: $*" >&2
	exit 1
}
STEP=start
now() { date +%s.%N; }
T0=$(now)
step() { # step NAME: start timing a step (and report the previous one)
	local t
	t=$(now)
	[ "$STEP" = start ] || printf 'images: %-34s %6.2fs\n' "$STEP" "$(echo "$t - $T0" | awk '{print $1 - $3}')" >&2
	STEP=$1
	T0=$t
}

mkdir -p "$IMAGES" || die "cannot create $IMAGES"
step "lock $IMAGES"
exec 9>"$IMAGES/.lock"
flock 9 || die "cannot lock $IMAGES/.lock"

ARCH=$(dpkg --print-architecture) || die "dpkg --print-architecture"

# Scratch dirs of a run that was killed: we hold the lock, so nobody uses them.
for d in "$IMAGES"/.work-*; do
	[ -d "$d" ] || continue
	for m in $(awk -v d="$d/" 'index($5, d) == 1 {print $5}' /proc/self/mountinfo | sort -r); do
		umount -l "$m" 2>/dev/null || true
	done
	rm -rf --one-file-system "$d"
done

# tmpdir NAME: a scratch dir under the cache, removed (after detaching any mounts a
# failed debootstrap left inside it) when the script ends.
SCRATCH=()
cleanup_scratch() {
	local d m
	for d in "${SCRATCH[@]}"; do
		[ -d "$d" ] || continue
		# deepest first
		for m in $(awk -v d="$d/" 'index($5, d) == 1 {print $5}' /proc/self/mountinfo | sort -r); do
			umount -l "$m" 2>/dev/null || true
		done
		rm -rf --one-file-system "$d"
	done
}
trap 'rc=$?; cleanup_scratch; [ $rc -eq 0 ] || echo "images.sh: FAILED at step '"'"'$STEP'"'"' (exit $rc)" >&2' EXIT
tmpdir() { # tmpdir NAME: sets TMPD (not echoed: a $(...) subshell would lose SCRATCH)
	TMPD=$(mktemp -d "$IMAGES/.work-$1.XXXXXX") || die "mktemp"
	SCRATCH+=("$TMPD")
}

sha() { sha256sum "$1" | cut -d' ' -f1; }
size() { stat -c %s "$1"; }

# layer DIR OUT: packs DIR as a gzip layer blob OUT; prints "<diffid> <digest> <size>".
layer() {
	local dir=$1 out=$2
	tar -C "$dir" --numeric-owner --sort=name --xattrs --xattrs-include='security.capability' \
		-cf "$out.tar" . || die "tar $dir"
	local diffid
	diffid=$(sha "$out.tar")
	gzip -n -f "$out.tar" || die "gzip"
	mv "$out.tar.gz" "$out"
	echo "$diffid $(sha "$out") $(size "$out")"
}

# pack NAME REF CMDJSON LAYERINFO...: writes $IMAGES/NAME.tar atomically from layer
# blobs given as "path diffid digest size".
pack() {
	local name=$1 ref=$2 cmd=$3
	shift 3
	tmpdir "$name-oci"
	local oci=$TMPD
	mkdir -p "$oci/blobs/sha256"
	local diffids="" layers="" sep="" l path diffid digest sz
	for l in "$@"; do
		read -r path diffid digest sz <<<"$l"
		cp "$path" "$oci/blobs/sha256/$digest" || die "copy layer"
		diffids+="$sep\"sha256:$diffid\""
		layers+="$sep{\"mediaType\":\"application/vnd.oci.image.layer.v1.tar+gzip\",\"digest\":\"sha256:$digest\",\"size\":$sz}"
		sep=,
	done
	local cfg=$oci/config.json
	printf '{"architecture":"%s","os":"linux","config":{"Env":["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"],"Cmd":%s,"WorkingDir":"/"},"rootfs":{"type":"layers","diff_ids":[%s]}}' \
		"$ARCH" "$cmd" "$diffids" >"$cfg"
	local cdig csz
	cdig=$(sha "$cfg")
	csz=$(size "$cfg")
	mv "$cfg" "$oci/blobs/sha256/$cdig"
	local man=$oci/manifest.json
	printf '{"schemaVersion":2,"mediaType":"application/vnd.oci.image.manifest.v1+json","config":{"mediaType":"application/vnd.oci.image.config.v1+json","digest":"sha256:%s","size":%s},"layers":[%s]}' \
		"$cdig" "$csz" "$layers" >"$man"
	local mdig msz
	mdig=$(sha "$man")
	msz=$(size "$man")
	mv "$man" "$oci/blobs/sha256/$mdig"
	printf '{"schemaVersion":2,"mediaType":"application/vnd.oci.image.index.v1+json","manifests":[{"mediaType":"application/vnd.oci.image.manifest.v1+json","digest":"sha256:%s","size":%s,"platform":{"architecture":"%s","os":"linux"},"annotations":{"io.containerd.image.name":"%s","org.opencontainers.image.ref.name":"%s"}}]}' \
		"$mdig" "$msz" "$ARCH" "$ref" "${ref##*:}" >"$oci/index.json"
	printf '{"imageLayoutVersion":"1.0.0"}' >"$oci/oci-layout"
	tar -C "$oci" --numeric-owner -cf "$IMAGES/$name.tar.tmp" oci-layout index.json blobs || die "tar archive"
	mv "$IMAGES/$name.tar.tmp" "$IMAGES/$name.tar"
}

# fresh NAME KEY: true if the cached archive was built from KEY.
fresh() { [ -f "$IMAGES/$1.tar" ] && [ "$(cat "$IMAGES/$1.key" 2>/dev/null)" = "$2" ]; }
stamp() { echo "$2" >"$IMAGES/$1.key.tmp" && mv "$IMAGES/$1.key.tmp" "$IMAGES/$1.key"; }

apt_download() { # apt_download DIR PKG: fetch PKG's .deb into DIR (apt-get update once if needed)
	(cd "$1" && apt-get download "$2" >/dev/null 2>&1) && return 0
	apt-get update -qq >/dev/null 2>&1 || true
	(cd "$1" && apt-get download "$2") || die "apt-get download $2"
}

build_busybox() {
	local key="recipe=$BUSYBOX_RECIPE arch=$ARCH"
	step "busybox: check cache"
	if fresh busybox "$key"; then
		step "busybox: cached"
		return
	fi
	tmpdir busybox
	local w=$TMPD
	step "busybox: apt-get download"
	apt_download "$w" busybox-static
	step "busybox: rootfs"
	dpkg -x "$w"/busybox-static_*.deb "$w/x" || die "dpkg -x"
	local r=$w/rootfs
	mkdir -p "$r"/{bin,sbin,usr/bin,usr/sbin,etc,proc,sys,dev,tmp,root,run,var/tmp}
	chmod 1777 "$r/tmp" "$r/var/tmp"
	cp "$w/x/bin/busybox" "$r/bin/busybox" || die "no bin/busybox in busybox-static"
	# One process makes all applet links (/bin/sh, /usr/bin/env, ... -> /bin/busybox).
	chroot "$r" /bin/busybox --install -s || die "busybox --install"
	[ -L "$r/bin/sh" ] || die "busybox has no sh applet"
	printf 'root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534:nobody:/nonexistent:/bin/false\n' >"$r/etc/passwd"
	printf 'root:x:0:\nnogroup:x:65534:\n' >"$r/etc/group"
	step "busybox: layer"
	local info
	info=$(layer "$r" "$w/layer.tgz")
	step "busybox: pack"
	pack busybox localhost/lazyfork/busybox:latest '["/bin/sh"]' "$w/layer.tgz $info"
	stamp busybox "$key"
}

build_python() {
	local wl
	wl=$(cd "$WORKLOADS" && cat $(ls *.py 2>/dev/null | sort) 2>/dev/null | sha256sum | cut -d' ' -f1)
	local basekey="recipe=$PYTHON_RECIPE arch=$ARCH suite=$SUITE"
	local key="$basekey sqlite=$SQLITE_RECIPE workloads=$wl"
	step "python: check cache"
	if fresh python "$key"; then
		step "python: cached"
		return
	fi
	local base=$IMAGES/.python-base.tgz
	if [ ! -f "$base" ] || [ "$(cat "$base.key" 2>/dev/null)" != "$basekey" ]; then
		tmpdir python
		local w=$TMPD r=$TMPD/rootfs
		step "python: debootstrap (~40 s)"
		debootstrap --variant=minbase --include=python3-minimal "$SUITE" "$r" "$MIRROR" >"$w/debootstrap.log" 2>&1 ||
			{ tail -20 "$w/debootstrap.log" >&2; die "debootstrap $SUITE from $MIRROR (log above)"; }
		step "python: trim"
		rm -rf "$r"/usr/share/{doc,man,info,locale,lintian,linda}/* "$r"/var/lib/apt/lists/* \
			"$r"/var/cache/apt/* "$r"/var/cache/debconf/*-old "$r"/var/log/* "$r"/dev/*
		find "$r/usr/lib/python3"* -name '__pycache__' -prune -exec rm -rf {} + 2>/dev/null || true
		chroot "$r" python3 -c 'import sys; assert sys.version_info >= (3, 9)' || die "python3 does not run in the rootfs"
		step "python: base layer"
		local info
		info=$(layer "$r" "$w/base.tgz")
		mv "$w/base.tgz" "$base.tmp" && mv "$base.tmp" "$base"
		echo "$info" >"$base.info"
		echo "$basekey" >"$base.key"
	fi
	local sq=$IMAGES/.python-sqlite.tgz sqkey="recipe=$SQLITE_RECIPE arch=$ARCH"
	if [ ! -f "$sq" ] || [ "$(cat "$sq.key" 2>/dev/null)" != "$sqkey" ]; then
		step "python: sqlite layer"
		tmpdir python-sqlite
		local w3=$TMPD
		apt_download "$w3" libsqlite3-0
		apt_download "$w3" libpython3.11-stdlib
		dpkg -x "$w3"/libsqlite3-0_*.deb "$w3/x" || die "dpkg -x libsqlite3-0"
		dpkg -x "$w3"/libpython3.11-stdlib_*.deb "$w3/y" || die "dpkg -x libpython3.11-stdlib"
		local r3=$w3/rootfs
		mkdir -p "$r3/usr/lib/python3.11/lib-dynload"
		cp -a "$w3/x/usr/lib/." "$r3/usr/lib/" || die "no libsqlite3 in libsqlite3-0"
		cp -a "$w3/y/usr/lib/python3.11/sqlite3" "$r3/usr/lib/python3.11/" || die "no sqlite3 module in libpython3.11-stdlib"
		cp -a "$w3/y/usr/lib/python3.11/lib-dynload/"_sqlite3.*.so "$r3/usr/lib/python3.11/lib-dynload/" || die "no _sqlite3 in libpython3.11-stdlib"
		find "$r3" -name '__pycache__' -prune -exec rm -rf {} + 2>/dev/null || true
		find "$r3" -exec touch -h -d @0 {} +
		local info3
		info3=$(layer "$r3" "$w3/sqlite.tgz")
		mv "$w3/sqlite.tgz" "$sq.tmp" && mv "$sq.tmp" "$sq"
		echo "$info3" >"$sq.info"
		echo "$sqkey" >"$sq.key"
	fi
	step "python: workloads layer"
	tmpdir python-wl
	local w2=$TMPD
	mkdir -p "$w2/rootfs/opt/lazyfork/workloads"
	cp "$WORKLOADS"/*.py "$w2/rootfs/opt/lazyfork/workloads/" 2>/dev/null || die "no workloads in $WORKLOADS"
	chmod 0755 "$w2/rootfs/opt" "$w2/rootfs/opt/lazyfork" "$w2/rootfs/opt/lazyfork/workloads"
	chmod 0644 "$w2/rootfs/opt/lazyfork/workloads"/*.py
	touch -d @0 "$w2/rootfs" "$w2/rootfs"/opt "$w2/rootfs"/opt/lazyfork "$w2/rootfs"/opt/lazyfork/workloads
	local info2
	info2=$(layer "$w2/rootfs" "$w2/wl.tgz")
	step "python: pack"
	pack python localhost/lazyfork/python:latest '["python3"]' "$base $(cat "$base.info")" "$sq $(cat "$sq.info")" "$w2/wl.tgz $info2"
	stamp python "$key"
}

build_node() {
	local key="recipe=$NODE_RECIPE arch=$ARCH suite=$SUITE"
	step "node: check cache"
	if fresh node "$key"; then
		step "node: cached"
		return
	fi
	tmpdir node
	local w=$TMPD r=$TMPD/rootfs
	step "node: debootstrap (~60 s)"
	debootstrap --variant=minbase --include=nodejs "$SUITE" "$r" "$MIRROR" >"$w/debootstrap.log" 2>&1 ||
		{ tail -20 "$w/debootstrap.log" >&2; die "debootstrap $SUITE with nodejs from $MIRROR (log above)"; }
	step "node: trim"
	rm -rf "$r"/usr/share/{doc,man,info,locale,lintian,linda}/* "$r"/var/lib/apt/lists/* \
		"$r"/var/cache/apt/* "$r"/var/cache/debconf/*-old "$r"/var/log/* "$r"/dev/*
	chroot "$r" node -e 'process.exit(typeof BigInt === "function" ? 0 : 1)' || die "node does not run in the rootfs"
	step "node: layer"
	local info
	info=$(layer "$r" "$w/layer.tgz")
	step "node: pack"
	pack node localhost/lazyfork/node:latest '["node"]' "$w/layer.tgz $info"
	stamp node "$key"
}

# The pause program: PID 1 of a pod sandbox. It must reap (a pod sharing its PID
# namespace hands it every orphan) and exit 0 on SIGINT/SIGTERM.
PAUSE_C='#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>
static void bye(int s) { (void)s; _exit(0); }
static void reap(int s) { (void)s; while (waitpid(-1, 0, WNOHANG) > 0) {} }
int main(void) {
	struct sigaction a = {0};
	a.sa_handler = bye;
	sigaction(SIGINT, &a, 0);
	sigaction(SIGTERM, &a, 0);
	a.sa_handler = reap;
	a.sa_flags = SA_NOCLDSTOP | SA_RESTART;
	sigaction(SIGCHLD, &a, 0);
	for (;;) pause();
}'

build_pause() {
	local key
	key="recipe=$PAUSE_RECIPE arch=$ARCH src=$(printf '%s' "$PAUSE_C" | sha256sum | cut -d' ' -f1)"
	step "pause: check cache"
	if fresh pause "$key"; then
		step "pause: cached"
		return
	fi
	command -v gcc >/dev/null || die "pause needs gcc (apt-get install gcc libc6-dev)"
	tmpdir pause
	local w=$TMPD r=$TMPD/rootfs
	step "pause: gcc -static"
	mkdir -p "$r"
	printf '%s\n' "$PAUSE_C" >"$w/pause.c"
	gcc -static -Os -s -o "$r/pause" "$w/pause.c" || die "gcc -static pause.c (static libc: libc6-dev)"
	touch -d @0 "$r" "$r/pause"
	step "pause: layer"
	local info
	info=$(layer "$r" "$w/layer.tgz")
	step "pause: pack"
	pack pause "$PAUSE_REF" '["/pause"]' "$w/layer.tgz $info"
	stamp pause "$key"
}

for n in "${names[@]}"; do
	"build_$n"
done
step done
if [ $print_path = 1 ]; then
	for n in "${names[@]}"; do echo "$IMAGES/$n.tar"; done
fi
