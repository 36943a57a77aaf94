#!/usr/bin/env bash
# deps.sh installs, idempotently, everything LazyFork runs on: Debian packages,
# CRIU 4.1.1 (linking only libc, built from Debian's trixie source tarball:
# bookworm's 3.17 fails on recent kernels), containerd/ctr v2.4.2, runc v1.5.3
# (seccomp, static), nerdctl v2.2.1 and the CNI plugins. Each step prints its
# time and is skipped when already right.
#
# A binary is only replaced when its version is wrong, and then atomically (built
# into a staging directory, renamed over the old one): a running containerd, shim
# or an exec of runc never sees a half-written file. A binary that a running
# process executes is not replaced unless LAZYFORK_DEPS_FORCE=1.
#
# Environment:
#   LAZYFORK_CACHE      where sources and build products are cached (/var/cache/lazyfork)
#   PREFIX              where binaries go (/usr/local)
#   LAZYFORK_DEPS_DRY_RUN=1  check only: print what would be installed, change nothing
#   LAZYFORK_DEPS_FORCE=1    replace binaries even while a process runs them
set -euo pipefail

CACHE=${LAZYFORK_CACHE:-/var/cache/lazyfork}
PREFIX=${PREFIX:-/usr/local}
CRIU_VERSION=4.1.1
CONTAINERD_VERSION=v2.4.2
RUNC_VERSION=v1.5.3
NERDCTL_VERSION=v2.2.1
CNI_VERSION=v1.10.0
export PATH=$PREFIX/sbin:$PREFIX/bin:/usr/local/go/bin:$PATH
export GOTOOLCHAIN=${GOTOOLCHAIN:-local}
export GOFLAGS=${GOFLAGS:-}

APT_PACKAGES=(
	build-essential pkg-config git ca-certificates xz-utils
	libprotobuf-dev libprotobuf-c-dev protobuf-c-compiler protobuf-compiler python3-protobuf
	libnl-3-dev libcap-dev libnet1-dev libaio-dev libbsd-dev uuid-dev libdrm-dev
	libseccomp-dev iptables debootstrap dpkg-dev util-linux iproute2 procps
	libjemalloc2 libjemalloc-dev libmimalloc2.0 libmimalloc-dev xfsprogs
)

step_name=""
step_start=0
die() { echo "deps: FAILED at step '$step_name': $*" >&2; exit 1; }
trap 'rc=$?; [ $rc -ne 0 ] && [ -n "$step_name" ] && echo "deps: FAILED at step \"$step_name\" (exit $rc)" >&2' EXIT
begin() { step_name=$1; step_start=$(date +%s.%N); }
end() {
	local t; t=$(awk -v a="$step_start" -v b="$(date +%s.%N)" 'BEGIN{printf "%.1f", b-a}')
	printf 'deps: %-12s %-40s %6ss\n' "$step_name" "$1" "$t"
	step_name=""
}

# has_output PATTERN CMD...: CMD's output (stderr ignored) has a line matching
# the extended regex PATTERN. The output is captured first: `CMD | grep -q` under
# pipefail fails with 141 when grep exits before CMD has written everything
# (runc --version writes four lines), which looked like a wrong version.
has_output() {
	local pat=$1 out
	shift
	out=$("$@" 2>/dev/null) || return 1
	[[ $out =~ $pat ]]
}

DRY_RUN=${LAZYFORK_DEPS_DRY_RUN:-0}
# would STEP WHAT: in a dry run, report what the step would do and skip it.
would() {
	if [ "$DRY_RUN" = 1 ]; then
		end "would $1"
		return 0
	fi
	return 1
}

# users_of FILE: pids of processes executing FILE.
users_of() {
	local f=$1 exe pid
	for exe in /proc/[0-9]*/exe; do
		[ "$(readlink "$exe" 2>/dev/null)" = "$f" ] || continue
		pid=${exe#/proc/}
		echo "${pid%/exe}"
	done
}

# put_bin SRC DST: install SRC as DST by rename (atomic), refusing to replace a
# binary a process runs unless LAZYFORK_DEPS_FORCE=1.
put_bin() {
	local src=$1 dst=$2 pids
	if [ -e "$dst" ] && [ "${LAZYFORK_DEPS_FORCE:-0}" != 1 ]; then
		pids=$(users_of "$(readlink -f "$dst")" | tr '\n' ' ')
		[ -z "$pids" ] || die "$dst is in use (pids $pids): stop them first, or set LAZYFORK_DEPS_FORCE=1"
	fi
	install -m 0755 "$src" "$dst.lazyfork-new" || die "install $dst"
	mv -f "$dst.lazyfork-new" "$dst" || die "rename $dst"
}

# go_install GOBIN_DIR [go install args...]: build into a staging directory, then
# put_bin every binary built into GOBIN_DIR.
go_install() {
	local dst=$1 stage b
	shift
	stage=$(mktemp -d "$CACHE/stage.XXXXXX")
	GOBIN=$stage go install "$@" || { rm -rf "$stage"; return 1; }
	for b in "$stage"/*; do
		put_bin "$b" "$dst/$(basename "$b")"
	done
	rm -rf "$stage"
}

[ "$(id -u)" = 0 ] || { echo "deps: must run as root" >&2; exit 1; }
mkdir -p "$CACHE" "$PREFIX/bin" "$PREFIX/sbin"

# --- Debian packages ---------------------------------------------------------
begin apt
missing=()
for p in "${APT_PACKAGES[@]}"; do
	has_output "ok installed" dpkg-query -W -f='${Status}' "$p" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
	would "install ${missing[*]}" && missing=()
fi
if [ ${#missing[@]} -gt 0 ]; then
	apt-get update -qq || die "apt-get update"
	DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null \
		|| die "apt-get install ${missing[*]}"
	end "installed ${#missing[@]} packages"
else
	end "all ${#APT_PACKAGES[@]} present"
fi

# bookworm's criu 3.17 fails on this kernel ("Unexpected rt vDSO area bounds");
# remove it so runc cannot pick it up from /usr/sbin.
begin criu-old
if has_output "ok installed" dpkg-query -W -f='${Status}' criu; then
	if ! would "remove Debian criu"; then
		DEBIAN_FRONTEND=noninteractive apt-get remove -y -qq criu >/dev/null || die "apt-get remove criu"
		end "removed Debian criu"
	fi
else
	end "none installed"
fi

# --- CRIU ----------------------------------------------------------------------
# CRIU starts at every fork's restore and every snapshot, and forks itself
# for each task it restores, so it is built to link nothing but libc: without
# GnuTLS (NO_GNUTLS=1), which only its TLS page server uses, and with the
# static archives of its other libraries (protobuf-c, libnl, libnet, libbsd,
# libmd, libuuid: a directory holding only those, first on the linker's path,
# given through the environment so that CRIU's own LDFLAGS still apply).
# `criu --version` takes 5.1-5.8 ms against 9.6 ms linked as before on a
# 2-core EPYC guest, where a fork's restore spent 3 ms of CRIU's CPU in the
# dynamic loader. A CRIU of the right version linked otherwise is rebuilt.
CRIU_STATIC_LIBS=(protobuf-c nl-3 net bsd md uuid)
criu_lean() { local IFS='|'; ! has_output "lib(gnutls|${CRIU_STATIC_LIBS[*]})\\.so" ldd "$1"; }
begin criu
if has_output "Version: $CRIU_VERSION" "$PREFIX/sbin/criu" --version && criu_lean "$PREFIX/sbin/criu"; then
	end "$CRIU_VERSION present"
elif would "build CRIU $CRIU_VERSION"; then
	:
else
	src=$CACHE/criu
	mkdir -p "$src"
	tarball=$src/criu_$CRIU_VERSION.orig.tar.xz
	if [ ! -s "$tarball" ]; then
		list=/etc/apt/sources.list.d/lazyfork-trixie-src.sources
		if [ ! -f "$list" ]; then
			cat >"$list" <<-SRC
			Types: deb-src
			URIs: http://deb.debian.org/debian
			Suites: trixie
			Components: main
			Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
			SRC
		fi
		apt-get update -qq || die "apt-get update (trixie sources)"
		# The .dsc may answer 404; the orig tarball still arrives, which is all we need.
		(cd "$src" && apt-get source --download-only "criu/trixie" >/dev/null 2>&1 || true)
		[ -s "$tarball" ] || die "could not download criu_$CRIU_VERSION.orig.tar.xz"
	fi
	build=$src/criu-$CRIU_VERSION
	if [ ! -x "$build/criu/criu" ] || ! criu_lean "$build/criu/criu"; then
		rm -rf "$build"
		tar -C "$src" -xf "$tarball" || die "untar CRIU"
		libs=$src/static-libs
		rm -rf "$libs"; mkdir -p "$libs"
		for l in "${CRIU_STATIC_LIBS[@]}"; do
			a=$(gcc -print-file-name="lib$l.a")
			[ -f "$a" ] || die "no lib$l.a (its Debian -dev package installs it)"
			ln -s "$a" "$libs/"
		done
		LDFLAGS=-L$libs make -C "$build" -j"$(nproc)" NO_GNUTLS=1 criu >"$src/build.log" 2>&1 || { tail -30 "$src/build.log" >&2; die "make criu"; }
		criu_lean "$build/criu/criu" || die "CRIU links more than libc: $(ldd "$build/criu/criu")"
	fi
	put_bin "$build/criu/criu" "$PREFIX/sbin/criu"
	end "built $CRIU_VERSION"
fi
begin criu-check
if [ "$DRY_RUN" = 1 ] && [ ! -x "$PREFIX/sbin/criu" ]; then
	end "skipped (no criu yet)"
else
	out=$("$PREFIX/sbin/criu" check 2>&1) || die "criu check: $out"
	[[ $out == *"Looks good"* ]] || die "criu check: $out"
	end "criu check: Looks good"
fi

# --- Go-built binaries (module cache and build cache make re-runs cheap) -----

begin containerd
if has_output " $CONTAINERD_VERSION " containerd --version \
	&& has_output "$CONTAINERD_VERSION" ctr --version \
	&& [ -x "$PREFIX/bin/containerd-shim-runc-v2" ]; then
	end "$CONTAINERD_VERSION present"
elif would "install containerd $CONTAINERD_VERSION"; then
	:
else
	go_install "$PREFIX/bin" \
		-ldflags "-X github.com/containerd/containerd/v2/version.Version=$CONTAINERD_VERSION" \
		github.com/containerd/containerd/v2/cmd/containerd@$CONTAINERD_VERSION \
		github.com/containerd/containerd/v2/cmd/ctr@$CONTAINERD_VERSION \
		github.com/containerd/containerd/v2/cmd/containerd-shim-runc-v2@$CONTAINERD_VERSION \
		|| die "go install containerd $CONTAINERD_VERSION"
	has_output "$CONTAINERD_VERSION" containerd --version || die "containerd --version: $(containerd --version)"
	end "installed $CONTAINERD_VERSION"
fi

# runc is built as its own Makefile's `static` target and release binaries
# are (tags seccomp urfave_cli_no_docs netgo osusergo, linked -static, libseccomp
# included): no dynamic loading and no man-page templates parsed at start.
# Each runc run is 3-4 ms shorter for it on a 2-core EPYC guest (`runc
# --version` 13.6 against 9.9 ms), and a fresh container runs runc four times
# (create, init, start, delete), a fork's restore once. A dynamic runc of the
# right version is rebuilt.
static_binary() { ! ldd "$1" >/dev/null 2>&1; }
begin runc
if has_output "runc version ${RUNC_VERSION#v}" runc --version && static_binary "$(command -v runc)"; then
	end "$RUNC_VERSION present"
elif would "install runc $RUNC_VERSION"; then
	:
else
	CGO_ENABLED=1 go_install "$PREFIX/sbin" -trimpath -tags "seccomp urfave_cli_no_docs netgo osusergo" \
		-ldflags "-X main.version=${RUNC_VERSION#v} -extldflags -static" \
		github.com/opencontainers/runc@$RUNC_VERSION || die "go install runc $RUNC_VERSION"
	end "installed $RUNC_VERSION"
fi

begin nerdctl
if has_output "version ${NERDCTL_VERSION#v}\$" nerdctl --version; then
	end "$NERDCTL_VERSION present"
elif would "install nerdctl $NERDCTL_VERSION"; then
	:
else
	# The module's go.mod replaces a test-only module (./mod/tigron) that the
	# proxy does not serve: build from a patched copy without its test helpers.
	go mod download github.com/containerd/nerdctl/v2@$NERDCTL_VERSION || die "download nerdctl"
	modsrc=$(go env GOMODCACHE)/github.com/containerd/nerdctl/v2@$NERDCTL_VERSION
	work=$CACHE/nerdctl-$NERDCTL_VERSION
	rm -rf "$work"; cp -r "$modsrc" "$work"; chmod -R u+w "$work"
	rm -f "$work/cmd/nerdctl/helpers/testing_linux.go"
	mkdir -p "$work/mod/tigron"
	printf 'module github.com/containerd/nerdctl/mod/tigron\n\ngo 1.24\n' >"$work/mod/tigron/go.mod"
	(cd "$work" && GOFLAGS=-mod=mod go_install "$PREFIX/bin" \
		-ldflags "-X github.com/containerd/nerdctl/v2/pkg/version.Version=$NERDCTL_VERSION" \
		./cmd/nerdctl) || die "build nerdctl"
	end "installed $NERDCTL_VERSION"
fi

begin cni
if [ -x /opt/cni/bin/bridge ] && [ -f /opt/cni/bin/.lazyfork-$CNI_VERSION ]; then
	end "$CNI_VERSION present"
elif would "install CNI plugins $CNI_VERSION"; then
	:
else
	mkdir -p /opt/cni/bin
	go_install /opt/cni/bin \
		github.com/containernetworking/plugins/plugins/main/bridge@$CNI_VERSION \
		github.com/containernetworking/plugins/plugins/main/loopback@$CNI_VERSION \
		github.com/containernetworking/plugins/plugins/ipam/host-local@$CNI_VERSION \
		github.com/containernetworking/plugins/plugins/meta/portmap@$CNI_VERSION \
		|| die "go install CNI plugins"
	touch /opt/cni/bin/.lazyfork-$CNI_VERSION
	end "installed $CNI_VERSION"
fi

begin versions
if [ "$DRY_RUN" = 1 ]; then
	end "dry run: nothing changed"
else
	out=$("$PREFIX/sbin/criu" --version); echo "deps: criu ${out%%$'\n'*}"
	echo "deps: $(containerd --version)"
	out=$(runc --version); echo "deps: ${out%%$'\n'*}"
	echo "deps: $(nerdctl --version)"
	end "all present"
fi
