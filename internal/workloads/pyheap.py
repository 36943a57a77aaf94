"""pyheap: a CPython workload for LazyFork's fidelity tests (stdlib only).

The process holds a heap of bytearrays with patterns it can recompute, runs worker
threads that allocate, check and drop their own buffers, and forks a child process
that holds and checks its own heap. Protocol, as for cheap.c:
  - prints "tick N bad=B child=alive|dead" every tick;
  - SIGUSR1: check everything, print "verify tick=N ok=0|1 ... marker=V", and pass the
    signal to the child, which prints "child-verify ok=0|1 ...";
  - SIGUSR2: write a new marker and rewrite block 0, print "marker tick=N value=V".

Usage: pyheap.py [heapMiB=64] [tickMs=100]
"""
import hashlib
import os
import random
import signal
import sys
import threading
import time

BLOCK = 256 * 1024


def pattern(ident, gen, size):
    seed = hashlib.sha256(b"%d/%d" % (ident, gen)).digest()
    return (seed * (size // len(seed) + 1))[:size]


class Heap:
    def __init__(self, mib, base):
        self.base = base
        self.blocks = []
        self.gens = []
        for i in range(mib * 1024 * 1024 // BLOCK):
            self.blocks.append(bytearray(pattern(base + i, 0, BLOCK)))
            self.gens.append(0)

    def check(self, i):
        return self.blocks[i] == pattern(self.base + i, self.gens[i], BLOCK)

    def bad_blocks(self):
        return sum(1 for i in range(len(self.blocks)) if not self.check(i))

    def rewrite(self, i):
        self.gens[i] += 1
        self.blocks[i][:] = pattern(self.base + i, self.gens[i], BLOCK)


def emit(line):
    # One write(2) a line. The parent and its child share one stdout, and print()
    # writes the text and its newline separately when stdout is unbuffered
    # (PYTHONUNBUFFERED=1, python -u): the other process's line then lands in
    # between, glued to this one, and a reader looking for "child-verify" at the
    # start of a line misses it.
    os.write(1, (line + "\n").encode())


bad = 0
bad_lock = threading.Lock()
want_verify = False
want_marker = False


def add_bad(n):
    global bad
    with bad_lock:
        bad += n


def worker(ident):
    rnd = random.Random(ident)
    r = 0
    while True:
        r += 1
        bufs = [(k, bytes(pattern(ident * 10000 + k, r, rnd.choice((4096, 65536, 200000)))))
                for k in range(64)]
        time.sleep(0.05)
        for k, b in bufs:
            if b != pattern(ident * 10000 + k, r, len(b)):
                add_bad(1)
        del bufs
        fresh = bytearray(1 << 20)
        if fresh.count(0) != len(fresh):
            add_bad(1)
        time.sleep(0.05)


def child_main(mib):
    heap = Heap(mib, 5000000)
    verify = [False]
    signal.signal(signal.SIGUSR1, lambda s, f: verify.__setitem__(0, True))
    signal.signal(signal.SIGUSR2, signal.SIG_IGN)
    n = 0
    while True:
        n += 1
        if n % 10 == 0:
            i = n % len(heap.blocks)
            if not heap.check(i):
                add_bad(1)
            heap.rewrite(i)
        if verify[0]:
            verify[0] = False
            b = heap.bad_blocks() + bad
            emit("child-verify ok=%d bad=%d blocks=%d" % (b == 0, b, len(heap.blocks)))
        time.sleep(0.1)


def main():
    global want_verify, want_marker
    mib = int(sys.argv[1]) if len(sys.argv) > 1 else 64
    tick_ms = int(sys.argv[2]) if len(sys.argv) > 2 else 100
    child_mib = max(1, mib // 4)
    child = os.fork()
    if child == 0:
        child_main(child_mib)
        os._exit(0)
    heap = Heap(mib, 0)
    marker = bytearray(4096)
    marker_value = 0
    for k in range(2):
        threading.Thread(target=worker, args=(k + 1,), daemon=True).start()
    signal.signal(signal.SIGUSR1, lambda s, f: globals().__setitem__("want_verify", True))
    signal.signal(signal.SIGUSR2, lambda s, f: globals().__setitem__("want_marker", True))
    emit("ready pid=%d heap=%d blocks=%d child=%d" % (os.getpid(), mib << 20, len(heap.blocks), child))
    rnd = random.Random(7)
    tick = 0
    cursor = 0
    child_alive = True
    while True:
        tick += 1
        for _ in range(4):
            if not heap.check(cursor):
                add_bad(1)
            cursor = (cursor + 1) % len(heap.blocks)
        heap.rewrite(1 + rnd.randrange(len(heap.blocks) - 1))
        if child_alive:
            pid, _ = os.waitpid(child, os.WNOHANG)
            child_alive = pid == 0
        emit("tick %d bad=%d child=%s" % (tick, bad, "alive" if child_alive else "dead"))
        time.sleep(tick_ms / 1000.0)
        if want_marker:
            want_marker = False
            marker_value = rnd.getrandbits(62) | 1
            marker[:8] = marker_value.to_bytes(8, "little")
            heap.rewrite(0)
            emit("marker tick=%d value=%d" % (tick, marker_value))
        if want_verify:
            want_verify = False
            b = heap.bad_blocks() + bad
            seen = int.from_bytes(marker[:8], "little")
            if seen != marker_value:
                b += 1
            ok = b == 0 and child_alive
            emit("verify tick=%d ok=%d checked=%d bad=%d marker=%d child=%s" % (
                tick, ok, len(heap.blocks) * BLOCK, b, seen, "alive" if child_alive else "dead"))
            if child_alive:
                os.kill(child, signal.SIGUSR1)


if __name__ == "__main__":
    main()
