"""Commit one row per SQLite transaction (synchronous=FULL); report each committed id."""

import sqlite3
import sys

db = sqlite3.connect(sys.argv[1], isolation_level=None)
db.execute("pragma journal_mode=wal")
db.execute("pragma synchronous=full")
db.execute("create table if not exists t (id integer primary key, pad blob)")
n = db.execute("select coalesce(max(id), 0) from t").fetchone()[0]
while True:
    n += 1
    db.execute("begin")
    db.execute("insert into t values (?, randomblob(3000))", (n,))
    db.execute("commit")
    sys.stdout.write(f"{n}\n")
    sys.stdout.flush()
