#!/bin/sh
# Regenerates tiny.tar.gz, the CRIU dump that memfile's root-free tests of the
# rewrite read (load_test.go): tiny.c, built static, run as a two-process tree
# and dumped with the installed CRIU. Needs root (CRIU) and gcc.
#   memfile/testdata/dumps/mkdumps.sh
# The tests check the program's known memory, not the exact bytes of the
# dump, so a dump made by another CRIU version passes as long as its image
# format is one criuimg reads.
set -eu
here=$(cd "$(dirname "$0")" && pwd)
work=$(mktemp -d)
trap 'kill -9 "$pid" 2>/dev/null || true; rm -rf "$work"' EXIT
gcc -static -O2 -o "$work/tiny" "$here/tiny.c"
mkdir "$work/img"
# Its own session, so CRIU needs no --shell-job; stdio on /dev/null.
setsid "$work/tiny" "$work" </dev/null >/dev/null 2>&1 &
pid=$!
while [ ! -e "$work/ready-parent" ] || [ ! -e "$work/ready-child" ]; do sleep 0.05; done
criu dump -t "$pid" -D "$work/img" -o dump.log -v4 || { tail -20 "$work/img/dump.log"; exit 1; }
rm -f "$work/img/dump.log" "$work/img/stats-dump"
# Fixed owner and times: regenerating an unchanged dump changes little.
tar -C "$work/img" --sort=name --owner=0 --group=0 --numeric-owner --mtime=@0 -cf - . | gzip -9n >"$here/tiny.tar.gz"
ls -l "$here/tiny.tar.gz"
