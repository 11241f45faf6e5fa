"""The plane under database faults and a graceful stop (issue 13 items 5, 7 and 8), through `qag serve --plane`.

Each database test starts a PRIVATE instance (its own directory and port, tests/e2e/plane_privdb.py), freezes it
with SIGSTOP or restarts it, and checks what callers of the plane see:

- frozen: a call the plane serves ends 504 `query_timeout` (Python's body) within its statement limit plus the
  plane's margin, and once the database answers again the plane serves on fresh sessions;
- restarted: no caller sees an error, and the plane serves every call itself (stale pooled sessions are
  dropped and the read retried on a fresh session, never forwarded to Python for it);
- SIGTERM to the arbiter: the plane refuses new connections (never accepts and resets one), finishes the
  calls in flight (those it forwards included: the workers stop after it), and every answered call's run is
  in the run store afterwards.
"""
from __future__ import annotations

import http.client
import json
import os
import signal
import sqlite3
import threading
import time

import pytest
import requests

from tests.conftest import start_server

LIMIT = 2.0  # QAG_QUERY_TIMEOUT of these instances; QAG_CONNECT_TIMEOUT is above it, so that a call that has to
# open a session to a frozen database meets the plane's deadline (504) before its connect timeout (forwarded)
MARGIN = 1.0  # rustplane/src/limits.rs DEADLINE_MARGIN
SLACK = 0.75  # the machine: two cores shared with the test, the server and the database

pytestmark = pytest.mark.usefixtures("plane")  # built by `make plane`, never under a test timeout


def _timeout_body(rid: str, seconds: float) -> bytes:
    from qag.errors import Timeout
    from qag.http.errors import answer
    return json.dumps(answer(Timeout(seconds)).body(rid)).encode()


def _serve(connection: dict, queries: dict) -> tuple:
    srv = start_server({"QAG_QUERY_TIMEOUT": str(LIMIT), "QAG_CONNECT_TIMEOUT": "5", "QAG_WORKERS": "1",
                        "QAG_PLANE_DEBUG": "1"},
                       args=("--workers", "1", "--plane", "--plane-threads", "1"))
    adm = {**srv.admin, "Content-Type": "application/json"}

    def post(path, body):
        r = requests.post(srv.base + path, json=body, headers=adm, timeout=30)
        assert r.status_code in (200, 201), (path, r.status_code, r.text)
        return r.json()
    post("/api/v1/connections", connection)
    for name, (sql, params) in queries.items():
        post("/api/v1/queries", {"name": name, "connection_name": connection["name"], "sql": sql,
                                 "parameters": params, "publish": True})
    key = post("/api/v1/api-keys", {"name": "rust_faults", "queries": ["*"], "connections": [connection["name"]]})
    return srv, key["secret"]


def _get(srv, path: str, key: str, rid: str, timeout: float = 30) -> tuple[int, bytes, float]:
    t = time.monotonic()
    r = requests.get(srv.base + path, headers={"X-API-Key": key, "X-Request-Id": rid}, timeout=timeout)
    return r.status_code, r.content, time.monotonic() - t


def _served_by(srv, query: str) -> dict[str, str]:
    out, cursor = {}, None
    while True:
        params = {"query": query, "limit": 1000, **({"cursor": cursor} if cursor else {})}
        r = requests.get(srv.base + "/api/v1/history", params=params, headers=srv.admin, timeout=30)
        assert r.status_code == 200, r.text
        doc = r.json()
        out.update({run["request_id"]: run["served_by"] for run in doc["items"]})
        cursor = doc.get("next_cursor")
        if not cursor:
            return out


def _parallel(n: int, fn) -> list:
    results: list = [None] * n

    def run(i):
        results[i] = fn(i)
    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return results


def _warm(srv, key, path: str, tag: str, n: int = 4) -> None:
    """Open n pooled sessions in the plane (n concurrent slow calls) and publish the plan."""
    for i in range(3):
        _get(srv, path, key, f"{tag}-seq{i}")
    got = _parallel(n, lambda i: _get(srv, path, key, f"{tag}-par{i}"))
    assert all(s == 200 for s, _, _ in got), got


def _wait_runs(srv, query: str, rids: list[str], timeout: float = 15) -> dict[str, str]:
    deadline = time.time() + timeout
    while True:
        runs = _served_by(srv, query)
        if all(r in runs for r in rids) or time.time() > deadline:
            return runs
        time.sleep(0.3)


# ------------------------------------------------------------------------------------------------ PostgreSQL
PG_QUERIES = {
    "fast": ("SELECT id, name FROM rust_t WHERE id = :id", {"id": "int"}),
    "nap": ("SELECT t.id FROM rust_t t, pg_sleep(:s) AS z WHERE t.id = 1", {"s": "float"}),
}


@pytest.fixture()
def private_pg():
    from tests.e2e.plane_privdb import PrivatePostgres
    pg = PrivatePostgres()
    try:
        pg.sql("CREATE DATABASE qag_rust_faults")
        pg.sql("CREATE TABLE rust_t (id int PRIMARY KEY, name text); "
               "INSERT INTO rust_t SELECT i, 'n' || i FROM generate_series(1, 100) i", db="qag_rust_faults")
        yield pg
    finally:
        pg.close()


def _pg_conn(pg) -> dict:
    return {"name": "rust_pg", "db": "postgres", "host": "127.0.0.1", "port": pg.port, "user": "postgres",
            "database": "qag_rust_faults"}


def test_frozen_postgres_calls_end_at_their_limit_with_pythons_504(private_pg):
    srv, key = _serve(_pg_conn(private_pg), PG_QUERIES)
    try:
        _warm(srv, key, "/q/nap?s=0.2", "warm")
        _warm(srv, key, "/q/fast?id=1", "warmf")
        # over the limit with the server alive: PostgreSQL cancels it; the plane answers Python's 504
        s, body, took = _get(srv, "/q/nap?s=3", key, "over")
        assert (s, body) == (504, _timeout_body("over", LIMIT)), body
        private_pg.freeze()
        try:
            got = _parallel(4, lambda i: _get(srv, f"/q/fast?id={i + 1}", key, f"frozen{i}"))
        finally:
            private_pg.thaw()
        for i, (s, body, took) in enumerate(got):
            assert s == 504 and body == _timeout_body(f"frozen{i}", LIMIT), (i, s, body)
            assert took < LIMIT + MARGIN + SLACK, f"call {i} took {took:.2f} s with the database frozen"
        # the sessions the frozen calls held were discarded: the next calls run on fresh ones
        after = [_get(srv, f"/q/fast?id={i + 1}", key, f"after{i}") for i in range(5)]
        assert all(s == 200 for s, _, _ in after), after
        runs = _wait_runs(srv, "fast", [f"frozen{i}" for i in range(4)] + [f"after{i}" for i in range(5)])
        assert all(runs.get(f"frozen{i}") == "plane" for i in range(4)), runs
        assert all(runs.get(f"after{i}") == "plane" for i in range(5)), runs
    finally:
        srv.stop()


def test_restarted_postgres_is_invisible_to_callers(private_pg):
    srv, key = _serve(_pg_conn(private_pg), PG_QUERIES)
    try:
        _warm(srv, key, "/q/nap?s=0.2", "warm")
        _warm(srv, key, "/q/fast?id=1", "warmf")
        private_pg.restart()
        got = [_get(srv, f"/q/fast?id={i % 100 + 1}", key, f"after{i}") for i in range(40)]
        got += _parallel(8, lambda i: _get(srv, "/q/nap?s=0.05", key, f"afterp{i}"))
        bad = [(i, s, b) for i, (s, b, _) in enumerate(got) if s != 200]
        assert not bad, bad
        runs = _wait_runs(srv, "fast", [f"after{i}" for i in range(40)])
        assert [r for r in (f"after{i}" for i in range(40)) if runs.get(r) != "plane"] == [], runs
    finally:
        srv.stop()


# ------------------------------------------------------------------------------------------------ MariaDB
MY_QUERIES = {
    "fast": ("SELECT id, name FROM rust_t WHERE id = :id", {"id": "int"}),
    "nap": ("SELECT id FROM rust_t WHERE id = 1 AND SLEEP(:s) = 0", {"s": "int"}),
}


@pytest.fixture()
def private_mariadb():
    from tests.e2e.plane_privdb import PrivateMariaDB
    my = PrivateMariaDB()
    try:
        my.sql("CREATE DATABASE qag_rust_faults")
        my.sql("CREATE TABLE rust_t (id int PRIMARY KEY, name text); "
               "INSERT INTO rust_t SELECT seq, CONCAT('n', seq) FROM seq_1_to_100", db="qag_rust_faults")
        yield my
    finally:
        my.close()


def _my_conn(my) -> dict:
    return {"name": "rust_my", "db": "mysql", "host": "127.0.0.1", "port": my.port, "user": "root",
            "database": "qag_rust_faults"}


def test_restarted_mariadb_is_invisible_to_callers(private_mariadb):
    srv, key = _serve(_my_conn(private_mariadb), MY_QUERIES)
    try:
        _warm(srv, key, "/q/nap?s=1", "warm")
        _warm(srv, key, "/q/fast?id=1", "warmf")
        private_mariadb.restart()
        got = [_get(srv, f"/q/fast?id={i % 100 + 1}", key, f"after{i}") for i in range(40)]
        bad = [(i, s, b) for i, (s, b, _) in enumerate(got) if s != 200]
        assert not bad, bad
        runs = _wait_runs(srv, "fast", [f"after{i}" for i in range(40)])
        assert [r for r in (f"after{i}" for i in range(40)) if runs.get(r) != "plane"] == [], runs
    finally:
        srv.stop()


def test_frozen_mariadb_calls_end_at_their_limit(private_mariadb):
    srv, key = _serve(_my_conn(private_mariadb), MY_QUERIES)
    try:
        _warm(srv, key, "/q/nap?s=1", "warm")
        _warm(srv, key, "/q/fast?id=1", "warmf")
        private_mariadb.freeze()
        try:
            got = _parallel(4, lambda i: _get(srv, f"/q/fast?id={i + 1}", key, f"frozen{i}"))
        finally:
            private_mariadb.thaw()
        for i, (s, body, took) in enumerate(got):
            assert s == 504 and body == _timeout_body(f"frozen{i}", LIMIT), (i, s, body)
            assert took < LIMIT + MARGIN + SLACK, f"call {i} took {took:.2f} s with the database frozen"
        after = [_get(srv, f"/q/fast?id={i + 1}", key, f"after{i}") for i in range(5)]
        assert all(s == 200 for s, _, _ in after), after
    finally:
        srv.stop()


# ------------------------------------------------------------------------------------------------ SIGTERM
def test_sigterm_refuses_new_connections_drains_and_records_every_answer(private_pg):
    """Callers open a new connection per call (so each call tests the listener) while the arbiter gets
    SIGTERM: each call is answered 200 (and recorded) or its connection is refused; none is accepted and
    then reset, none is a 502 from a plane whose workers are gone."""
    srv, key = _serve(_pg_conn(private_pg), PG_QUERIES)
    port = int(srv.base.rsplit(":", 1)[1])
    _warm(srv, key, "/q/nap?s=0.2", "warm")
    _warm(srv, key, "/q/fast?id=1", "warmf")
    outcomes: list[tuple[str, str, str]] = []  # (rid, path, outcome)
    lock = threading.Lock()

    def caller(n: int):
        i = 0
        refused = 0
        while refused < 3 and i < 5000:
            i += 1
            rid = f"t{n}-{i}"
            path = [f"/q/fast?id={i % 100 + 1}", "/health", "/q/nap?s=0.4"][(n + i) % 3]
            c = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
            try:
                c.request("GET", path, headers={"X-API-Key": key, "X-Request-Id": rid, "Connection": "close"})
                r = c.getresponse()
                r.read()
                out = str(r.status)
            except ConnectionRefusedError:
                out = "refused"
                refused += 1
                time.sleep(0.05)
            except (OSError, http.client.HTTPException) as exc:  # reset, EOF before a response...
                out = type(exc).__name__
            finally:
                c.close()
            with lock:
                outcomes.append((rid, path, out))

    threads = [threading.Thread(target=caller, args=(n,)) for n in range(4)]
    for t in threads:
        t.start()
    time.sleep(2.5)
    srv.proc.send_signal(signal.SIGTERM)
    for t in threads:
        t.join(60)
    assert srv.proc.wait(30) == 0
    kinds: dict[str, int] = {}
    for _, _, out in outcomes:
        kinds[out] = kinds.get(out, 0) + 1
    assert set(kinds) <= {"200", "refused"}, kinds
    assert kinds.get("refused", 0) >= 4 and kinds.get("200", 0) > 20, kinds
    # every answered data call was recorded (the plane's runs and the forwarded ones alike)
    answered = {rid for rid, path, out in outcomes if out == "200" and path.startswith("/q/")}
    db = sqlite3.connect(os.path.join(srv.env["QAG_HOME"], "runs.db"))
    try:
        have = {r for (r,) in db.execute("SELECT request_id FROM qag_history")}
    finally:
        db.close()
    missing = answered - have
    assert not missing, f"{len(missing)} of {len(answered)} answered calls have no run: {sorted(missing)[:5]}"
