"""sqlitewriter: writes a SQLite database in transactions, for fork tests.

Every tick (about 50 ms) one transaction inserts row N (N = the tick) with a
1 KiB blob and updates a running checksum row; it prints `tick N`. The
connection stays open across ticks, so a fork holds the database file, its
journal and the connection's state exactly as the parent had them.

SIGUSR1: `verify ok=0|1 rows=R first=F last=L integrity=... marks=M1,M2`:
ok=1 when rows F..L are all there, L is the last committed tick, the
checksum matches and PRAGMA integrity_check says ok.
SIGUSR2: inserts a random marker into table marks and prints `marker value=V`
(a fork must see its own markers only: each copy has its own database).

A copy on its own copy of the file (a fork) finds the connection refusing
writes with SQLITE_READONLY_DBMOVED (SQLite compares the inode it opened
with the path's); it then reopens the database, printing
`reopen reason=dbmoved tick=N`, and goes on.

Usage: python3 sqlitewriter.py [PATH] (default /var/tmp/lazyfork.db); the
journal mode comes from LF_JOURNAL (default DELETE; WAL maps the -shm file
MAP_SHARED).
"""
import os
import random
import signal
import sqlite3
import sys
import time

path = sys.argv[1] if len(sys.argv) > 1 else "/var/tmp/lazyfork.db"


def connect():
    c = sqlite3.connect(path, isolation_level=None)
    c.execute("PRAGMA journal_mode=%s" % os.environ.get("LF_JOURNAL", "DELETE"))
    return c


db = connect()
db.execute("CREATE TABLE IF NOT EXISTS t(n INTEGER PRIMARY KEY, v BLOB NOT NULL)")
db.execute("CREATE TABLE IF NOT EXISTS sums(id INTEGER PRIMARY KEY, s INTEGER NOT NULL)")
db.execute("CREATE TABLE IF NOT EXISTS marks(v INTEGER NOT NULL)")
db.execute("INSERT OR IGNORE INTO sums VALUES(1, 0)")

want = {"verify": False, "mark": False}
signal.signal(signal.SIGUSR1, lambda *_: want.__setitem__("verify", True))
signal.signal(signal.SIGUSR2, lambda *_: want.__setitem__("mark", True))

last = db.execute("SELECT coalesce(max(n), 0) FROM t").fetchone()[0]
print("ready path=%s journal=%s" % (path, db.execute("PRAGMA journal_mode").fetchone()[0]), flush=True)
n = last
SQLITE_READONLY_DBMOVED = 1032


def commit(n):
    db.execute("BEGIN IMMEDIATE")
    db.execute("INSERT INTO t VALUES(?, randomblob(1024))", (n,))
    db.execute("UPDATE sums SET s = s + ? WHERE id = 1", (n,))
    db.execute("COMMIT")


while True:
    n += 1
    try:
        commit(n)
    except sqlite3.OperationalError as e:
        # SQLite remembers the inode of the file it opened: a copy of the
        # process on a copy of the file (a fork's own rootfs) sees another
        # inode at the same path and refuses to write through the old
        # connection. Reopening is what an application does.
        if getattr(e, "sqlite_errorcode", 0) != SQLITE_READONLY_DBMOVED:
            raise
        print("reopen reason=dbmoved tick=%d" % n, flush=True)
        db.close()
        db = connect()
        commit(n)
    print("tick %d" % n, flush=True)
    if want["mark"]:
        want["mark"] = False
        v = random.getrandbits(48)
        db.execute("INSERT INTO marks VALUES(?)", (v,))
        print("marker value=%d" % v, flush=True)
    if want["verify"]:
        want["verify"] = False
        rows, first, lastrow = db.execute("SELECT count(*), min(n), max(n) FROM t").fetchone()
        s = db.execute("SELECT s FROM sums WHERE id = 1").fetchone()[0]
        integrity = db.execute("PRAGMA integrity_check").fetchone()[0]
        marks = ",".join(str(r[0]) for r in db.execute("SELECT v FROM marks ORDER BY rowid"))
        ok = rows == lastrow - first + 1 and lastrow == n and s == sum(range(first, lastrow + 1)) and integrity == "ok"
        print("verify ok=%d rows=%d first=%d last=%d integrity=%s marks=%s" % (ok, rows, first, lastrow, integrity, marks or "-"), flush=True)
    time.sleep(0.05)
