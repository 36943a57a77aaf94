#!/usr/bin/env python3
"""counter.py: the workload of LazyFork's container tests and benchmarks.

Usage: python3 counter.py HEAP_MIB [--out FILE] [--interval SECONDS] [--writes-per-signal N]
                          [--grow-per-signal MIB]

Python 3 standard library only, and only modules python3-minimal has (no mmap,
no ctypes). In the python test image it lives at
/opt/lazyfork/workloads/counter.py.

Protocol (one line per event on stdout, flushed; also appended to FILE with --out):

  ready heap_mib=M pages=P fill_s=S pid=N
      once the heap (a bytearray) is filled: P pages of 4 KiB, page i holding
      a pattern derived from i (8-byte words, see page_pattern), so a page moved,
      lost, zeroed or shared with a writer shows up in a verify.
  tick N
      about every --interval seconds (default 0.1), N = 1, 2, 3, ... The counter
      lives in the process's memory, so a restored copy continues from the tick
      after its checkpoint.
  verify ok pages=P writes=W        on SIGUSR1: every page checked and intact
  verify BAD page=I first_bad_offset=O got=HEX want=HEX bad_pages=K writes=W
      (W = markers this process wrote itself, which its verify expects)
  wrote page=I writes=W             on SIGUSR2: a marker ("lazyfork-write-W")
      was written at the start of page I; this process expects it from then on,
      another copy must not see it. With --writes-per-signal N, N markers go to
      N pages 7919 apart (each a page of its own until the heap is covered)
      and the line names the last.
  grew mib=M total_mib=T            on SIGUSR2 with --grow-per-signal M, before its
      wrote line: M MiB more memory of its own (a new bytearray, filled), T in all.
  exit ticks=N                      on SIGTERM, then exit status 0.

Signals are acted on by the main loop, between ticks (within one interval). Send
one signal and wait for its line before the next of the same kind: like any
process, two identical signals that arrive before the first is handled merge.
Do not use --out in a container that will be checkpointed and restored elsewhere:
CRIU checks an open file's size on restore.
"""

import os
import signal
import struct
import sys
import time

PAGE = 4096
MULT = 0x9E3779B97F4A7C15  # odd 64-bit constant: distinct words for distinct pages
MASK = (1 << 64) - 1


def page_pattern(i):
    """The 4 KiB content of page i: its mixed index as 512 little-endian words."""
    return struct.pack("<Q", ((i + 1) * MULT) & MASK) * (PAGE // 8)


def marker(w):
    return b"lazyfork-write-%d" % w


class Counter:
    def __init__(self, heap_mib, out):
        self.npages = heap_mib * (1 << 20) // PAGE
        self.out = open(out, "a") if out else None
        self.written = {}  # page -> marker written there by this process
        self.writes = 0
        t0 = time.monotonic()
        # python3-minimal has no mmap module: a bytearray is malloc'd (an mmap
        # for this size), zeroed, then filled 1 MiB per assignment.
        self.heap = bytearray(self.npages * PAGE)
        mv = memoryview(self.heap)
        chunk = (1 << 20) // PAGE
        for first in range(0, self.npages, chunk):
            last = min(first + chunk, self.npages)
            mv[first * PAGE:last * PAGE] = b"".join(page_pattern(i) for i in range(first, last))
        self.fill_s = time.monotonic() - t0

    def emit(self, line):
        sys.stdout.write(line + "\n")
        sys.stdout.flush()
        if self.out:
            self.out.write(line + "\n")
            self.out.flush()

    def expected(self, i):
        p = page_pattern(i)
        m = self.written.get(i)
        if m is not None:
            p = m + p[len(m):]
        return p

    def verify(self):
        mv = memoryview(self.heap)
        bad = 0
        first = None
        for i in range(self.npages):
            want = self.expected(i)
            got = mv[i * PAGE:(i + 1) * PAGE]
            if got != want:
                bad += 1
                if first is None:
                    g = bytes(got)
                    off = next(k for k in range(PAGE) if g[k] != want[k])
                    first = (i, off, g[off:off + 8].hex(), want[off:off + 8].hex())
        if bad == 0:
            self.emit("verify ok pages=%d writes=%d" % (self.npages, self.writes))
        else:
            i, off, g, w = first
            self.emit("verify BAD page=%d first_bad_offset=%d got=%s want=%s bad_pages=%d writes=%d"
                      % (i, off, g, w, bad, self.writes))

    def write(self, n=1):
        for _ in range(n - 1):
            self.write_one()
        i = self.write_one()
        self.emit("wrote page=%d writes=%d" % (i, self.writes))

    def write_one(self):
        self.writes += 1
        # Spread the pages over the heap; a page is written at most once per pass.
        i = (self.writes * 7919) % self.npages
        m = marker(self.writes)
        self.heap[i * PAGE:i * PAGE + len(m)] = m
        self.written[i] = m
        return i


def main(argv):
    args = argv[1:]
    out = None
    interval = 0.1
    per_signal = 1
    grow_mib = 0
    grown = []
    pos = []
    while args:
        a = args.pop(0)
        if a == "--out" and args:
            out = args.pop(0)
        elif a == "--interval" and args:
            interval = float(args.pop(0))
        elif a == "--writes-per-signal" and args and args[0].isdigit() and int(args[0]) >= 1:
            per_signal = int(args.pop(0))
        elif a == "--grow-per-signal" and args and args[0].isdigit():
            grow_mib = int(args.pop(0))
        elif a in ("-h", "--help"):
            sys.stdout.write(__doc__)
            return 0
        else:
            pos.append(a)
    if len(pos) != 1 or not pos[0].isdigit() or int(pos[0]) < 1:
        sys.stderr.write("usage: counter.py HEAP_MIB [--out FILE] [--interval SECONDS] [--writes-per-signal N] [--grow-per-signal MIB]\n")
        return 2
    pending = []

    def on_signal(signum, _frame):
        pending.append(signum)

    # Before the fill, so that an early signal waits instead of killing us.
    for s in (signal.SIGUSR1, signal.SIGUSR2, signal.SIGTERM):
        signal.signal(s, on_signal)
    c = Counter(int(pos[0]), out)
    c.pending = pending
    c.emit("ready heap_mib=%s pages=%d fill_s=%.3f pid=%d" % (pos[0], c.npages, c.fill_s, os.getpid()))
    n = 0
    while True:
        while c.pending:
            s = c.pending.pop(0)
            if s == signal.SIGUSR1:
                c.verify()
            elif s == signal.SIGUSR2:
                if grow_mib:
                    grown.append(bytearray(b"\x5a") * (grow_mib << 20))
                    c.emit("grew mib=%d total_mib=%d" % (grow_mib, grow_mib * len(grown)))
                c.write(per_signal)
            elif s == signal.SIGTERM:
                c.emit("exit ticks=%d" % n)
                return 0
        n += 1
        c.emit("tick %d" % n)
        time.sleep(interval)


if __name__ == "__main__":
    sys.exit(main(sys.argv))
