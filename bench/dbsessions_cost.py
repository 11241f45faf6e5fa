#!/usr/bin/env python3
"""What the session rules of qag/connectors.py (S2 read-only transaction in the statement's message, S4 watchdog,
S5 checks) cost one read, in-process: the lookup of the seeds through Connector.run, the current module against
another copy of it (default: the one at git revision BASE), alternating rounds, PostgreSQL and MariaDB.

    PYTHONPATH=. python bench/dbsessions_cost.py [--base 0abf9db] [--calls 3000] [--rounds 5]
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from qag import config, connectors  # noqa: E402

CFG = config.load({"QAG_QUERY_TIMEOUT": "30"})
PG = {"name": "pg", "db": "postgres", "host": "127.0.0.1", "port": 5432, "user": "postgres",
      "database": "qag_dbsess_bench", "options": {}}
MY = {"name": "my", "db": "mysql", "host": "127.0.0.1", "port": 3306, "user": "root", "database": "qag_dbsess_bench",
      "options": {}}


def load_base(rev: str):
    src = subprocess.run(["git", "show", f"{rev}:qag/connectors.py"], capture_output=True, text=True, check=True).stdout
    path = os.path.join(tempfile.mkdtemp(), "base_connectors.py")
    with open(path, "w") as f:
        f.write(src)
    spec = importlib.util.spec_from_file_location("base_connectors", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def seed():
    import mysql.connector
    import psycopg2
    c = psycopg2.connect(host="127.0.0.1", user="postgres", dbname="postgres")
    c.autocommit = True
    cur = c.cursor()
    cur.execute("DROP DATABASE IF EXISTS qag_dbsess_bench")
    cur.execute("CREATE DATABASE qag_dbsess_bench")
    c.close()
    c = psycopg2.connect(host="127.0.0.1", user="postgres", dbname="qag_dbsess_bench")
    c.autocommit = True
    c.cursor().execute("CREATE TABLE acc AS SELECT g AS aid, 0 AS abalance FROM generate_series(1, 10000) g; "
                       "ALTER TABLE acc ADD PRIMARY KEY (aid)")
    c.close()
    m = mysql.connector.connect(host="127.0.0.1", user="root", autocommit=True)
    cur = m.cursor()
    cur.execute("DROP DATABASE IF EXISTS qag_dbsess_bench")
    cur.execute("CREATE DATABASE qag_dbsess_bench")
    cur.execute("CREATE TABLE qag_dbsess_bench.acc (aid INT PRIMARY KEY, abalance INT)")
    cur.executemany("INSERT INTO qag_dbsess_bench.acc VALUES (%s, 0)", [(i,) for i in range(1, 10001)])
    m.close()


def per_call(conn, sql: str, n: int, **kw) -> tuple[float, float]:
    """(wall, this process's CPU) microseconds per read."""
    t0, c0 = time.perf_counter(), time.process_time()
    for i in range(n):
        conn.run(sql, (1 + i % 10000,), write=False, timeout=None, max_rows=None, **kw)
    return (time.perf_counter() - t0) / n * 1e6, (time.process_time() - c0) / n * 1e6


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--base", default="0abf9db")
    ap.add_argument("--calls", type=int, default=3000)
    ap.add_argument("--rounds", type=int, default=5)
    a = ap.parse_args()
    seed()
    base = load_base(a.base)
    for row, sql in ((PG, "SELECT aid, abalance FROM acc WHERE aid = %s"),
                     (MY, "SELECT aid, abalance FROM acc WHERE aid = %s")):
        new = connectors.make(row, None, CFG)
        old = base.make(row, None, CFG)
        free = connectors.state_free(sql.replace("%s", "NULL"), row["db"])
        per_call(new, sql, 200, state_free=free)
        per_call(old, sql, 200)
        res: dict[str, list[tuple[float, float]]] = {"base": [], "now": [], "reset": []}
        for r in range(a.rounds):  # alternating, the order reversed every other round
            order = ("base", "now", "reset") if r % 2 else ("reset", "now", "base")
            for k in order:
                if k == "base":
                    res[k].append(per_call(old, sql, a.calls))
                else:
                    res[k].append(per_call(new, sql, a.calls, state_free=free and k == "now"))
        for i, what in ((0, "wall"), (1, "cpu ")):
            b = statistics.median(r[i] for r in res["base"])
            for k, label in (("now", f"now (state_free={free})"), ("reset", "now, reset after each (not proven)")):
                n = statistics.median(r[i] for r in res[k])
                print(f"{row['db']:8s} {what} base {b:7.1f} us/read  {label}: {n:7.1f} us/read "
                      f"({(n - b) / b * 100:+.1f}%, {n - b:+.1f} us)")
        new.close()
        old.close()


if __name__ == "__main__":
    main()
