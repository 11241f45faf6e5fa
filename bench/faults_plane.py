#!/usr/bin/env python3
"""Fault experiments of the Rust data plane (issue 13 items 5, 7, 8; issue 12 class 7's cost), each through a
real `qag serve --plane` on PRIVATE database instances (their own directories and ports, started, frozen,
restarted and stopped here; never the machine's shared servers).

    PYTHONPATH=$PWD bench/faults_plane.py [frozen] [restart] [sigterm] [readonly] [--out results.jsonl]

Experiments (default: all but readonly), each printing JSON lines:
- `frozen`: the data database SIGSTOPped for `--freeze` s while `--callers` callers call a warm plane
  (statement limit `--limit` s): every call's status and duration (the plane's promise: none longer than the
  limit + 1 s), then whether the plane serves again after SIGCONT. PostgreSQL and MariaDB.
- `restart`: the database restarted under a warm plane, then `--calls` sequential calls: statuses and who
  served them (the promise: no error, and the plane serves them itself). PostgreSQL and MariaDB.
- `sigterm`: 4 callers opening a new connection per call while the arbiter gets SIGTERM: outcomes (200,
  refused, reset, 502) and answered calls without a run in the store.
- `readonly`: what a read costs the plane in calls/s, latency and database CPU, alternating the plane binaries
  given with `--bin` (e.g. without and with the explicit read-only transaction), `--rounds` rounds each.

"Before" figures: point QAG_PLANE_BIN at an older plane build and PYTHONPATH at an older checkout (the arbiter's
stop order is Python's). The results of 2026-12-01 are in bench/results/2026-12-01-faults/plane.md.
"""
from __future__ import annotations

import argparse
import http.client
import json
import os
import signal
import sqlite3
import statistics
import sys
import threading
import time

import requests

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tests.conftest import start_server
from tests.e2e.plane_privdb import PrivateMariaDB, PrivatePostgres

OUT = None


def emit(doc: dict) -> None:
    line = json.dumps(doc, sort_keys=True)
    print(line, flush=True)
    if OUT:
        with open(OUT, "a") as f:
            f.write(line + "\n")


def private(db: str):
    if db == "postgres":
        d = PrivatePostgres()
        d.sql("CREATE DATABASE qag_rust_faults")
        d.sql("CREATE TABLE rust_t (id int PRIMARY KEY, name text); "
              "INSERT INTO rust_t SELECT i, 'n' || i FROM generate_series(1, 1000) i", db="qag_rust_faults")
        conn = {"name": "rust_db", "db": "postgres", "host": "127.0.0.1", "port": d.port, "user": "postgres",
                "database": "qag_rust_faults"}
        queries = {"fast": ("SELECT id, name FROM rust_t WHERE id = :id", {"id": "int"}),
                   "nap": ("SELECT t.id FROM rust_t t, pg_sleep(:s) AS z WHERE t.id = 1", {"s": "float"})}
    else:
        d = PrivateMariaDB()
        d.sql("CREATE DATABASE qag_rust_faults")
        d.sql("CREATE TABLE rust_t (id int PRIMARY KEY, name text); "
              "INSERT INTO rust_t SELECT seq, CONCAT('n', seq) FROM seq_1_to_1000", db="qag_rust_faults")
        conn = {"name": "rust_db", "db": "mysql", "host": "127.0.0.1", "port": d.port, "user": "root",
                "database": "qag_rust_faults"}
        queries = {"fast": ("SELECT id, name FROM rust_t WHERE id = :id", {"id": "int"}),
                   "nap": ("SELECT id FROM rust_t WHERE id = 1 AND SLEEP(:s) = 0", {"s": "int"})}
    return d, conn, queries


def serve(conn: dict, queries: dict, limit: float, env: dict | None = None):
    srv = start_server({"QAG_QUERY_TIMEOUT": str(limit), "QAG_CONNECT_TIMEOUT": str(limit + 3), "QAG_WORKERS": "1",
                        **(env or {})}, args=("--workers", "1", "--plane", "--plane-threads", "1"))
    adm = {**srv.admin, "Content-Type": "application/json"}

    def post(path, body):
        r = requests.post(srv.base + path, json=body, headers=adm, timeout=30)
        assert r.status_code in (200, 201), (path, r.status_code, r.text)
        return r.json()
    post("/api/v1/connections", conn)
    for name, (sql, params) in queries.items():
        post("/api/v1/queries", {"name": name, "connection_name": conn["name"], "sql": sql, "parameters": params,
                                 "publish": True})
    key = post("/api/v1/api-keys", {"name": "rust_faults", "queries": ["*"], "connections": [conn["name"]]})["secret"]
    return srv, key


def call(srv, path: str, key: str, rid: str, timeout: float = 120) -> tuple[str, float]:
    t = time.monotonic()
    try:
        r = requests.get(srv.base + path, headers={"X-API-Key": key, "X-Request-Id": rid}, timeout=timeout)
        out = str(r.status_code)
    except requests.RequestException as exc:
        out = type(exc).__name__
    return out, time.monotonic() - t


def parallel(n: int, fn) -> list:
    res: list = [None] * n

    def run(i):
        res[i] = fn(i)
    ts = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    return res


def warm(srv, key, db: str, sessions: int) -> None:
    nap = "/q/nap?s=0.3" if db == "postgres" else "/q/nap?s=1"
    for i in range(3):
        call(srv, "/q/fast?id=1", key, f"w{i}")
        call(srv, nap, key, f"wn{i}")
    parallel(sessions, lambda i: call(srv, nap, key, f"wp{i}"))


def served_by(srv, query: str) -> dict[str, str]:
    out, cursor = {}, None
    while True:
        params = {"query": query, "limit": 1000, **({"cursor": cursor} if cursor else {})}
        doc = requests.get(srv.base + "/api/v1/history", params=params, headers=srv.admin, timeout=30).json()
        out.update({r["request_id"]: r["served_by"] for r in doc["items"]})
        cursor = doc.get("next_cursor")
        if not cursor:
            return out


def counts(xs) -> dict:
    out: dict = {}
    for x in xs:
        out[x] = out.get(x, 0) + 1
    return out


# ---------------------------------------------------------------------------------------------------- frozen
def frozen(args) -> None:
    for db in ("postgres", "mariadb"):
        d, conn, queries = private(db)
        try:
            srv, key = serve(conn, queries, args.limit)
            try:
                warm(srv, key, db, args.callers)
                results: list[tuple[str, float]] = []
                lock = threading.Lock()
                stop = time.monotonic() + args.freeze
                d.freeze()

                def caller(n):
                    i = 0
                    while time.monotonic() < stop:
                        i += 1
                        r = call(srv, f"/q/fast?id={i % 1000 + 1}", key, f"f{n}-{i}")
                        with lock:
                            results.append(r)
                threads = [threading.Thread(target=caller, args=(n,)) for n in range(args.callers)]
                for t in threads:
                    t.start()
                time.sleep(args.freeze)
                d.thaw()
                for t in threads:
                    t.join()
                after = [call(srv, f"/q/fast?id={i + 1}", key, f"a{i}")[0] for i in range(20)]
                durations = sorted(t for _, t in results)
                emit({"experiment": "frozen", "db": db, "limit_s": args.limit, "freeze_s": args.freeze,
                      "callers": args.callers, "calls": len(results), "statuses": counts(s for s, _ in results),
                      "p50_s": round(statistics.median(durations), 3) if durations else None,
                      "max_s": round(durations[-1], 3) if durations else None,
                      "over_limit_plus_1s": sum(t > args.limit + 1.25 for t in durations),
                      "after_thaw": counts(after)})
            finally:
                srv.stop()
        finally:
            d.close()


# ---------------------------------------------------------------------------------------------------- restart
def restart(args) -> None:
    for db in ("postgres", "mariadb"):
        d, conn, queries = private(db)
        try:
            srv, key = serve(conn, queries, args.limit)
            try:
                warm(srv, key, db, 4)
                d.restart()
                got = [call(srv, f"/q/fast?id={i % 1000 + 1}", key, f"r{i}")[0] for i in range(args.calls)]
                time.sleep(2)
                runs = served_by(srv, "fast")
                emit({"experiment": "restart", "db": db, "calls": len(got), "statuses": counts(got),
                      "served_by": counts(runs.get(f"r{i}", "missing").split(":")[0] for i in range(args.calls))})
            finally:
                srv.stop()
        finally:
            d.close()


# ---------------------------------------------------------------------------------------------------- sigterm
def sigterm(args) -> None:
    d, conn, queries = private("postgres")
    try:
        srv, key = serve(conn, queries, args.limit)
        port = int(srv.base.rsplit(":", 1)[1])
        warm(srv, key, "postgres", 4)
        outcomes: list[tuple[str, str, str]] = []
        lock = threading.Lock()

        def caller(n):
            i = refused = 0
            while refused < 3 and i < 20000:
                i += 1
                rid = f"t{n}-{i}"
                path = [f"/q/fast?id={i % 1000 + 1}", "/health", "/q/nap?s=0.4"][(n + i) % 3]
                c = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
                try:
                    c.request("GET", path, headers={"X-API-Key": key, "X-Request-Id": rid, "Connection": "close"})
                    r = c.getresponse()
                    r.read()
                    out = str(r.status)
                except ConnectionRefusedError:
                    out, refused = "refused", refused + 1
                    time.sleep(0.05)
                except (OSError, http.client.HTTPException) as exc:
                    out = type(exc).__name__
                finally:
                    c.close()
                with lock:
                    outcomes.append((rid, path, out))
        ts = [threading.Thread(target=caller, args=(n,)) for n in range(4)]
        for t in ts:
            t.start()
        time.sleep(3)
        srv.proc.send_signal(signal.SIGTERM)
        for t in ts:
            t.join()
        code = srv.proc.wait(60)
        answered = {rid for rid, path, out in outcomes if out == "200" and path.startswith("/q/")}
        db = sqlite3.connect(os.path.join(srv.env["QAG_HOME"], "runs.db"))
        try:
            have = {r for (r,) in db.execute("SELECT request_id FROM qag_history")}
        finally:
            db.close()
        emit({"experiment": "sigterm", "exit": code, "outcomes": counts(o for _, _, o in outcomes),
              "answered_data_calls": len(answered), "answered_without_run": len(answered - have)})
    finally:
        d.close()


# ---------------------------------------------------------------------------------------------------- readonly
def _cpu_ticks(pids: list[int]) -> int:
    total = 0
    for p in pids:
        try:
            with open(f"/proc/{p}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])  # utime + stime
        except OSError:
            pass
    return total


def _pg_backends(d) -> list[int]:
    return d._pids()


def readonly(args) -> None:
    bins = args.bin or [os.environ.get("QAG_PLANE_BIN") or ""]
    d, conn, queries = private("postgres")
    try:
        for rnd in range(args.rounds):
            for b in (bins if rnd % 2 == 0 else list(reversed(bins))):
                env = {"QAG_PLANE_BIN": b} if b else {}
                srv, key = serve(conn, queries, 30, env)
                try:
                    port = int(srv.base.rsplit(":", 1)[1])
                    for i in range(50):
                        call(srv, f"/q/fast?id={i + 1}", key, f"w{i}")
                    lat: list[float] = []
                    lock = threading.Lock()
                    stop = time.monotonic() + args.secs

                    def caller(n):
                        c = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
                        mine, i = [], 0
                        while time.monotonic() < stop:
                            i += 1
                            t = time.perf_counter()
                            c.request("GET", f"/q/fast?id={(n * 7919 + i) % 1000 + 1}", headers={"X-API-Key": key})
                            r = c.getresponse()
                            r.read()
                            assert r.status == 200, r.status
                            mine.append(time.perf_counter() - t)
                        c.close()
                        with lock:
                            lat.extend(mine)
                    pids = _pg_backends(d)
                    c0, t0 = _cpu_ticks(pids), time.monotonic()
                    parallel(args.conns, caller)
                    c1, t1 = _cpu_ticks(pids), time.monotonic()
                    lat.sort()
                    hz = os.sysconf("SC_CLK_TCK")
                    emit({"experiment": "readonly", "bin": os.path.basename(b) or "default", "round": rnd,
                          "conns": args.conns, "calls": len(lat), "calls_per_s": round(len(lat) / (t1 - t0), 1),
                          "p50_ms": round(lat[len(lat) // 2] * 1000, 3),
                          "p99_ms": round(lat[int(len(lat) * 0.99)] * 1000, 3),
                          "db_cpu_us_per_call": round((c1 - c0) / hz * 1e6 / max(1, len(lat)), 1)})
                finally:
                    srv.stop()
    finally:
        d.close()


def main() -> None:
    global OUT
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("experiments", nargs="*", default=["frozen", "restart", "sigterm"])
    ap.add_argument("--limit", type=float, default=5.0, help="QAG_QUERY_TIMEOUT of the instance (frozen, restart)")
    ap.add_argument("--freeze", type=float, default=12.0)
    ap.add_argument("--callers", type=int, default=4)
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--bin", action="append", help="a plane binary to compare (readonly; repeat)")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--secs", type=float, default=8.0)
    ap.add_argument("--conns", type=int, default=1)
    ap.add_argument("--out")
    args = ap.parse_args()
    OUT = args.out
    for e in args.experiments:
        {"frozen": frozen, "restart": restart, "sigterm": sigterm, "readonly": readonly}[e](args)


if __name__ == "__main__":
    main()
