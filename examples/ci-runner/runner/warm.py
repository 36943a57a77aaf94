# warm.py: a CI build container, warmed once and forked per job.
#
# usage: python3 -u warm.py MODULES FUNCS ROWS [JOB]
#
# Warm-up (what a real runner spends its first minutes on): import the
# toolchain (stdlib modules), "download and build" a project of MODULES
# generated modules with FUNCS functions each (source generated, compiled,
# executed: the build cache), and start the test database: ROWS rows with
# an index, served by a thread. Then print "warm ...".
#
# Without JOB it waits for SIGUSR1 and reads the job from /tmp/job ("NAME
# TESTS"): that is what each fork does. With JOB ("NAME TESTS") it runs it at
# once: a cold container. A job prints one "test_... ok" line per test and
# "job NAME done passed=P failed=F", then waits for SIGTERM so its memory can
# be read.
import collections, hashlib, signal, sys, threading, time

t0 = time.monotonic()
import argparse, ast, calendar, configparser, csv, datetime, dis, email.message  # noqa: E401,F401
import email.parser, inspect, ipaddress, logging, pickle, random, subprocess  # noqa: E401,F401
import tempfile, textwrap, tokenize, typing, urllib.parse  # noqa: E401,F401

modules_n, funcs_n, rows_n = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])

# The build: generate, compile and load the project.
project = {}
for m in range(modules_n):
    src = []
    for f in range(funcs_n):
        src.append(
            f"def f{f}(x):\n"
            f"    y = (x * {m + 1} + {f}) % 1000003\n"
            f"    for i in range({f % 7 + 1}):\n"
            f"        y = (y * 31 + i) % 1000003\n"
            f"    return y\n"
        )
    code = compile("\n".join(src), f"pkg/mod{m}.py", "exec")
    ns = {}
    exec(code, ns)
    project[m] = ns

# The test database and its service thread.
def row(i):
    return {"id": i, "key": hashlib.sha1(str(i).encode()).hexdigest(), "value": (i * 7919) % 104729}

table = [row(i) for i in range(rows_n)]
index = {r["key"]: r for r in table}
requests = collections.deque()
pending = threading.Semaphore(0)

def serve():
    while True:
        pending.acquire()
        key, box, done = requests.popleft()
        box.append(index.get(key))
        done.set()

threading.Thread(target=serve, daemon=True).start()

def query(key):
    box, done = [], threading.Event()
    requests.append((key, box, done))
    pending.release()
    done.wait()
    return box[0]

print(f"warm modules={modules_n} funcs={funcs_n} rows={rows_n} seconds={time.monotonic() - t0:.2f}", flush=True)

def run(job):
    name, tests = job.split()
    tests = int(tests)
    print(f"job {name} start", flush=True)
    passed = failed = 0
    for t in range(tests):
        i = (t * 7907 + len(name)) % rows_n
        r = query(hashlib.sha1(str(i).encode()).hexdigest())
        m = project[t % modules_n]
        got = m[f"f{t % funcs_n}"](r["value"])
        want = m[f"f{t % funcs_n}"]((i * 7919) % 104729)
        ok = r["id"] == i and got == want
        passed += ok
        failed += not ok
        print(f"test_{name}_{t} ... {'ok' if ok else 'FAIL'}", flush=True)
    print(f"job {name} done passed={passed} failed={failed}", flush=True)

signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
if len(sys.argv) > 4:
    run(sys.argv[4])
else:
    got = threading.Event()
    signal.signal(signal.SIGUSR1, lambda *_: got.set())
    while not got.wait(3600):
        pass
    with open("/tmp/job") as f:
        run(f.read())
while True:
    signal.pause()
