"""Writes through the Rust data plane (issue 19 part 3), on PostgreSQL and MariaDB, against Python's.

`qag serve --plane` with QAG_ALLOW_WRITES=1. One random sequence of write (and read) calls is made twice on the
same starting data: first straight to gunicorn's socket (Python), then through the plane's port. Each pair of
answers must be identical (status, body, headers apart from timing and the request id), the database's state
after each sequence identical (every table's rows and the sequence/auto-increment counters), the runs recorded
equivalent field by field (error text included), and the plane must have served the writes itself
(`served_by = plane` in the run history). A key without write permission is refused through the plane exactly as
Python refuses it, and the refused call runs no statement (no sequence value is taken, no row changes).
"""
from __future__ import annotations

import http.client
import os
import random
import time
import urllib.parse

import pytest

from tests.conftest import mysql_exec, need_plane, pg_exec, pg_fresh_db
from tests.e2e.test_plane_differential import UnixConn, _call, _history

PG_DB = "qag_plane_writes_e2e"
MY_DB = "qag_plane_writes_e2e"

PG_SCHEMA = """
CREATE TABLE accounts (id int PRIMARY KEY, balance int NOT NULL CHECK (balance >= -100), note text);
CREATE TABLE ledger (id serial PRIMARY KEY, aid int NOT NULL, amount int NOT NULL)
"""
# What a write can leave on its session (a function an administrator allowed with allow_unsafe: governance sees
# plain DML, the plane serves it), and a probe that writes down what it finds on its own session (connectors.py
# S5: a session is reset after every write, before anyone else uses it). Each statement is executed on its own.
PG_SESSION_STATE = [
    "CREATE TABLE funds (id int PRIMARY KEY)",
    "INSERT INTO funds SELECT generate_series(1, 20)",
    "CREATE TABLE pledges (id int PRIMARY KEY, aid int NOT NULL REFERENCES funds (id) DEFERRABLE INITIALLY DEFERRED)",
    "CREATE TABLE probes (id serial PRIMARY KEY, pid int NOT NULL, state text NOT NULL)",
    """CREATE FUNCTION leave_state() RETURNS int LANGUAGE plpgsql AS $$ BEGIN
       PERFORM set_config('qag.left', 'yes', false); PERFORM set_config('work_mem', '7MB', false);
       PERFORM pg_advisory_lock(4242); CREATE TEMP TABLE IF NOT EXISTS leftover (x int); LISTEN qag_left;
       RETURN 0; END $$""",
    """CREATE FUNCTION session_state() RETURNS text LANGUAGE sql AS $$ SELECT concat_ws(' ',
       CASE WHEN current_setting('qag.left', true) = 'yes' THEN 'setting' END,
       CASE WHEN current_setting('work_mem') = '7MB' THEN 'work_mem' END,
       CASE WHEN EXISTS (SELECT FROM pg_locks WHERE locktype = 'advisory' AND pid = pg_backend_pid()) THEN 'lock' END,
       CASE WHEN to_regclass('pg_temp.leftover') IS NOT NULL THEN 'temp' END,
       CASE WHEN EXISTS (SELECT FROM pg_listening_channels()) THEN 'listen' END) $$""",
]
PG_STATEFUL = {
    # leave_state() / 0: the function ran (its lock is a session's, kept when the statement fails), then the error
    "stateful": ("UPDATE accounts SET balance = balance + leave_state() / :d WHERE id = :id",
                 {"id": "int", "d": "int"}),
    # a pledge to a fund that does not exist fails at COMMIT (the deferred foreign key), after leave_state()
    "pledge": ("INSERT INTO pledges (id, aid) VALUES (:id + leave_state(), :aid)", {"id": "int", "aid": "int"}),
    "probe": ("INSERT INTO probes (pid, state) VALUES (pg_backend_pid(), session_state())", {}),
}
MY_SCHEMA = f"""
DROP DATABASE IF EXISTS {MY_DB};
CREATE DATABASE {MY_DB} CHARACTER SET utf8mb4;
USE {MY_DB};
CREATE TABLE accounts (id int PRIMARY KEY, balance int NOT NULL, note varchar(20)) ENGINE=InnoDB;
CREATE TABLE ledger (id int AUTO_INCREMENT PRIMARY KEY, aid int NOT NULL, amount int NOT NULL) ENGINE=InnoDB
"""

QUERIES = {
    "deposit": ("UPDATE accounts SET balance = balance + :delta WHERE id = :id",
                {"id": {"type": "int", "min": 1}, "delta": {"type": "int", "min": -1000, "max": 1000}}),
    "open_account": ("INSERT INTO accounts (id, balance, note) VALUES (:id, :balance, :note)",
                     {"id": "int", "balance": {"type": "int", "default": 0},
                      "note": {"type": "str", "required": False, "max_length": 40}}),
    "close_account": ("DELETE FROM accounts WHERE id = :id", {"id": "int"}),
    "book": ("INSERT INTO ledger (aid, amount) VALUES (:aid, :amount)", {"aid": "int", "amount": "int"}),
    "halve": ("UPDATE accounts SET balance = balance / :d WHERE id = :id", {"id": "int", "d": "int"}),
    "scale": ("UPDATE accounts SET balance = balance * :f WHERE id = :id", {"id": "int", "f": "float"}),
    "balances": ("SELECT id, balance, note FROM accounts ORDER BY id", {}),
    # a write that returns rows: the plane prepares it, sees a result set and forwards it before anything ran
    "close_returning": ("DELETE FROM accounts WHERE id = :id RETURNING id, balance", {"id": "int"}),
}
# over the server's 2 s limit (QAG_QUERY_TIMEOUT): cancelled by the database and rolled back, 504 (not in the
# random sequence: test_a_write_over_its_limit_is_rolled_back)
SLOW = {"postgres": "UPDATE accounts SET balance = balance + 1 + 0 * length(pg_sleep(:s)::text) WHERE id = :id",
        "mariadb": "UPDATE accounts SET balance = balance + 1 + SLEEP(:s) WHERE id = :id"}
START = [(i, 100 * i, f"acct {i}") for i in range(1, 21)]


def _seed_pg(dsn):
    pg_exec(dsn, "TRUNCATE accounts, ledger RESTART IDENTITY", None)
    for row in START:
        pg_exec(dsn, "INSERT INTO accounts VALUES (%s, %s, %s)", row)


def _state_pg(dsn):
    return (pg_exec(dsn, "SELECT id, balance, note FROM accounts ORDER BY id", None),
            pg_exec(dsn, "SELECT id, aid, amount FROM ledger ORDER BY id", None),
            pg_exec(dsn, "SELECT last_value, is_called FROM ledger_id_seq", None))


def _seed_my(_):
    mysql_exec(f"TRUNCATE TABLE {MY_DB}.accounts")
    mysql_exec(f"TRUNCATE TABLE {MY_DB}.ledger")
    for row in START:
        mysql_exec(f"INSERT INTO {MY_DB}.accounts VALUES (%s, %s, %s)", row)


def _state_my(_):
    return (mysql_exec(f"SELECT id, balance, note FROM {MY_DB}.accounts ORDER BY id"),
            mysql_exec(f"SELECT id, aid, amount FROM {MY_DB}.ledger ORDER BY id"),
            mysql_exec("SELECT AUTO_INCREMENT FROM information_schema.TABLES WHERE TABLE_SCHEMA = %s "
                       "AND TABLE_NAME = 'ledger'", (MY_DB,)))


def _keys(srv, conn):
    def post(body):
        import requests
        r = requests.post(srv.base + "/api/v1/api-keys", json=body, headers=srv.admin, timeout=30)
        assert r.status_code == 201, r.text
        return r.json()["secret"]
    return {"writer": post({"name": "writer", "queries": ["*"], "connections": [conn], "allow_writes": True}),
            "updater": post({"name": "updater", "queries": ["*"], "connections": [conn], "allow_writes": True,
                             "allowed_write_ops": ["update"]}),
            "reader": post({"name": "reader", "queries": ["*"], "connections": [conn]})}


def _stack(connection, dialect, unsafe=None):
    import requests

    from tests.conftest import start_server
    srv = start_server({"QAG_WORKERS": "1", "QAG_ALLOW_WRITES": "1", "QAG_QUERY_TIMEOUT": "2"},
                       args=("--workers", "1", "--plane", "--plane-threads", "2"))
    r = requests.post(srv.base + "/api/v1/connections", json=connection, headers=srv.admin, timeout=30)
    assert r.status_code == 201, r.text
    queries = {**QUERIES, "slow_deposit": (SLOW[dialect], {"id": "int", "s": "int"})}
    for q, (sql, params) in queries.items():
        r = requests.post(srv.base + "/api/v1/queries", json={"name": q, "connection_name": connection["name"],
                                                              "sql": sql, "parameters": params, "publish": True},
                          headers=srv.admin, timeout=30)
        assert r.status_code == 201, r.text
    for q, (sql, params) in (unsafe or {}).items():
        r = requests.post(srv.base + "/api/v1/queries", json={"name": q, "connection_name": connection["name"],
                                                              "sql": sql, "parameters": params, "publish": True,
                                                              "allow_unsafe": True},
                          headers=srv.admin, timeout=30)
        assert r.status_code == 201, r.text
    srv.keys = _keys(srv, connection["name"])
    srv.sock = os.path.join(srv.env["QAG_HOME"], "gunicorn.sock")
    srv.port = int(srv.base.rsplit(":", 1)[1])
    return srv


@pytest.fixture(scope="module", params=["postgres", "mariadb"])
def stack(request):
    need_plane()
    if request.param == "postgres":
        dsn = pg_fresh_db(PG_DB)
        for stmt in PG_SCHEMA.split(";\n"):
            pg_exec(dsn, stmt, None)
        for stmt in PG_SESSION_STATE:
            pg_exec(dsn, stmt, None)
        srv = _stack({"name": "pg", "db": "postgres", "host": "127.0.0.1", "port": 5432, "user": "postgres",
                      "database": PG_DB}, "postgres", PG_STATEFUL)
        srv.seed, srv.state, srv.dsn = _seed_pg, _state_pg, dsn
    else:
        try:
            mysql_exec("SELECT 1")
        except Exception as exc:  # pragma: no cover - the CI has MariaDB
            pytest.skip(f"no MariaDB: {exc}")
        mysql_exec(MY_SCHEMA, multi=True)
        srv = _stack({"name": "my", "db": "mysql", "host": "127.0.0.1", "port": 3306, "user": "root",
                      "database": MY_DB}, "mariadb")
        srv.seed, srv.state, srv.dsn = _seed_my, _state_my, None
    srv.dialect = request.param
    yield srv
    srv.stop()
    if request.param == "mariadb":
        mysql_exec(f"DROP DATABASE IF EXISTS {MY_DB}")


def _random_call(rnd: random.Random) -> tuple[str, str]:
    who = rnd.choice(["writer"] * 6 + ["updater"] * 2 + ["reader"])
    q = rnd.choice(["deposit"] * 4 + ["open_account", "close_account", "book", "book", "halve", "scale", "balances",
                                      "close_returning"])
    p: list[tuple[str, str]] = []
    if q == "deposit":
        p += [("id", str(rnd.randint(1, 25))), ("delta", rnd.choice([str(rnd.randint(-60, 60))] * 8 + ["abc", "5000"]))]
    elif q == "open_account":
        p += [("id", str(rnd.randint(15, 40))), ("balance", str(rnd.randint(0, 50)))]
        if rnd.random() < 0.5:
            p.append(("note", rnd.choice(["new", "é and \"quotes\"", "x" * 30, "tab\there"])))
    elif q in ("close_account", "close_returning"):
        p.append(("id", str(rnd.randint(1, 40))))
    elif q == "book":
        p += [("aid", str(rnd.randint(1, 20))), ("amount", str(rnd.randint(-9, 9)))]
    elif q == "halve":
        p += [("id", str(rnd.randint(1, 25))), ("d", rnd.choice(["2", "2", "3", "0"]))]  # 0: division by zero
    elif q == "scale":
        p += [("id", str(rnd.randint(1, 25))), ("f", rnd.choice(["1.5", "0.5", "2"]))]
    if rnd.random() < 0.25:
        p.append(("format", rnd.choice(["json", "csv", "ndjson", "xml"])))
    rnd.shuffle(p)
    return who, f"/q/{q}?" + urllib.parse.urlencode(p) if p else f"/q/{q}"


def _run_sequence(srv, conn, calls, tag):
    out = []
    for i, (who, path) in enumerate(calls):
        rid = f"w{tag}{i}"
        status, body, headers = _call(conn, path, {"X-API-Key": srv.keys[who], "X-Request-Id": rid})
        assert headers.pop("x-request-id") == rid
        out.append((status, body.replace(rid.encode(), b"<rid>"), headers, rid))
    return out


def test_writes_differential(stack):
    srv = stack
    rnd = random.Random(20261202)
    calls = [_random_call(rnd) for _ in range(400)]
    srv.seed(srv.dsn)
    python = _run_sequence(srv, UnixConn(srv.sock), calls, "y")
    state_python = srv.state(srv.dsn)
    srv.seed(srv.dsn)
    plane = _run_sequence(srv, http.client.HTTPConnection("127.0.0.1", srv.port, timeout=30), calls, "p")
    state_plane = srv.state(srv.dsn)
    diffs = [(c, a[:3], b[:3]) for c, a, b in zip(calls, python, plane) if a[:3] != b[:3]]
    assert not diffs, f"{len(diffs)} of {len(calls)} answers differ; first: {diffs[:3]}"
    assert state_plane == state_python, "the database differs after the same calls"
    statuses = {a[0] for a in python}
    assert {200, 400, 403, 500} <= statuses, statuses  # writes, bad parameters, refusals, rejected statements

    time.sleep(2.0)  # the recorder's batches
    runs = {}
    for q in QUERIES:
        runs.update(_history(srv, q))
    served = {"writes": 0, "writes_total": 0, "failed": 0}
    for (who, path), a, b in zip(calls, python, plane):
        ry, rp = runs.get(a[3]), runs.get(b[3])
        assert ry is not None and rp is not None, (path, a[3], b[3])
        assert ry["served_by"].startswith("worker"), ry
        for f in ("query", "version", "key_name", "connection_name", "status", "code", "rows", "error"):
            assert rp[f] == ry[f], (f, who, path, rp, ry)
        # forwarded while nothing ran: reads, a format the plane does not render, and on PostgreSQL a float bound
        # where the statement infers an int (psycopg2 sends a numeric literal, the plane cannot bind it alike)
        if path.startswith(("/q/balances", "/q/close_returning", "/q/scale" if srv.dialect == "postgres" else "-")) \
                or "format=xml" in path:
            continue
        if a[0] in (200, 500):
            served["writes_total"] += 1
            served["writes"] += rp["served_by"] == "plane"
            served["failed"] += a[0] == 500 and rp["served_by"] == "plane"
    # the first call of each (key, query) publishes its plan, in the Python phase: the plane serves the rest
    assert served["writes"] > 0.9 * served["writes_total"], served
    assert served["failed"] > 0, "a rejected write is answered by the plane (never run twice)"


def test_a_key_without_write_permission_is_refused_and_runs_nothing(stack):
    srv = stack
    srv.seed(srv.dsn)
    before = srv.state(srv.dsn)
    plane = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=30)
    direct = UnixConn(srv.sock)
    for who, path, code in (("reader", "/q/book?aid=1&amount=5", "read_only"),
                            ("reader", "/q/deposit?id=1&delta=5", "read_only"),
                            ("updater", "/q/book?aid=1&amount=5", "write_op_not_allowed"),
                            ("updater", "/q/close_account?id=2", "write_op_not_allowed")):
        for k in range(3):
            a = _call(plane, path, {"X-API-Key": srv.keys[who], "X-Request-Id": f"ro-{k}"})
            b = _call(direct, path, {"X-API-Key": srv.keys[who], "X-Request-Id": f"ro-{k}"})
            assert a == b, (who, path, a, b)
            assert a[0] == 403 and f'"code": "{code}"'.encode() in a[1], a
    # nothing ran: no row changed and no sequence value was taken (a refused INSERT that ran would take one)
    assert srv.state(srv.dsn) == before
    # and a write the key may make right after is served by the plane
    a = _call(plane, "/q/deposit?id=1&delta=5", {"X-API-Key": srv.keys["updater"], "X-Request-Id": "ro-ok"})
    assert a[0] == 200 and a[1] == b'{"affected_rows": 1}' and a[2]["x-affected-rows"] == "1", a
    time.sleep(1.5)
    assert _history(srv, "deposit")["ro-ok"]["served_by"] == "plane"


def test_a_write_through_the_plane_commits_once(stack):
    """Each write served by the plane is committed, once: 50 deposits of 1 add 50, and 50 bookings take 50
    sequence values."""
    srv = stack
    srv.seed(srv.dsn)
    plane = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=30)
    h = {"X-API-Key": srv.keys["writer"]}
    for i in range(50):
        assert _call(plane, "/q/deposit?id=3&delta=1", h)[0] == 200
        assert _call(plane, f"/q/book?aid=3&amount={i}", h)[0] == 200
    accounts, ledger, _counter = srv.state(srv.dsn)
    assert [r for r in accounts if r[0] == 3][0][1] == 300 + 50
    assert [r[2] for r in ledger] == list(range(50)) and [r[0] for r in ledger] == list(range(1, 51))


def test_a_write_over_its_limit_is_rolled_back(stack):
    """A write the database cancels at its limit (QAG_QUERY_TIMEOUT 2 s): 504 query_timeout through the plane,
    answered by the plane exactly as Python answers it, and nothing committed."""
    srv = stack
    srv.seed(srv.dsn)
    before = srv.state(srv.dsn)
    plane, direct = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=30), UnixConn(srv.sock)
    h = {"X-API-Key": srv.keys["writer"], "X-Request-Id": "slow-w"}
    b = _call(direct, "/q/slow_deposit?id=4&s=0", h)  # Python publishes the plan (a quick call)
    assert b[0] == 200, b
    srv.seed(srv.dsn)
    b = _call(direct, "/q/slow_deposit?id=4&s=3", {**h, "X-Request-Id": "slow-y"})
    a = _call(plane, "/q/slow_deposit?id=4&s=3", {**h, "X-Request-Id": "slow-p"})
    assert a[0] == b[0] == 504 and a[1].replace(b"slow-p", b"slow-y") == b[1], (a, b)
    assert b'"code": "query_timeout", "request_id": "slow-y", "timeout": 2.0' in b[1], b
    assert srv.state(srv.dsn) == before, "a cancelled write commits nothing"
    time.sleep(1.5)
    runs = _history(srv, "slow_deposit")
    assert runs["slow-p"]["served_by"] == "plane" and runs["slow-p"]["code"] == "query_timeout", runs["slow-p"]


def test_a_write_leaves_nothing_on_its_session(stack):
    """PostgreSQL: every write through the plane leaves its session as it found it, whatever the write's outcome:
    committed, its statement failed (the transaction left failed by the server), its COMMIT failed (a deferred
    constraint). After each, a probe write on the same session finds no setting, advisory lock, temporary table
    or LISTEN left, and a good write commits (the session does not carry the failed transaction). Python's
    answers to the same calls are the plane's, and its sessions are left as clean."""
    srv = stack
    if srv.dialect != "postgres":
        pytest.skip("PostgreSQL's session state")
    h = {"X-API-Key": srv.keys["writer"]}
    calls = [("/q/probe", 200), ("/q/stateful?id=1&d=1", 200), ("/q/probe", 200),
             ("/q/stateful?id=1&d=0", 500), ("/q/probe", 200),           # the statement fails
             ("/q/pledge?id=1&aid=999", 500), ("/q/probe", 200),         # COMMIT fails
             ("/q/pledge?id=2&aid=5", 200), ("/q/probe", 200),
             ("/q/open_account?id=3&balance=1", 500), ("/q/deposit?id=4&delta=7", 200),  # a failure, then a write
             ("/q/stateful?id=6&d=0", 500), ("/q/deposit?id=6&delta=3", 200), ("/q/probe", 200)]
    direct = UnixConn(srv.sock)
    srv.seed(srv.dsn)
    for path in ("/q/probe", "/q/stateful?id=1&d=1", "/q/pledge?id=9&aid=5"):  # Python publishes the plans
        a = _call(direct, path, h)
        assert a[0] == 200, (path, a)
    answers, states = {}, {}
    for tag, conn in (("y", direct), ("p", http.client.HTTPConnection("127.0.0.1", srv.port, timeout=30))):
        srv.seed(srv.dsn)
        pg_exec(srv.dsn, "TRUNCATE pledges, probes", None)
        answers[tag] = []
        for i, (path, status) in enumerate(calls):
            a = _call(conn, path, {**h, "X-Request-Id": f"s{tag}{i}"})
            assert a[0] == status, (tag, path, a)
            answers[tag].append((a[0], a[1].replace(f"s{tag}{i}".encode(), b"<rid>")))
        states[tag] = (srv.state(srv.dsn), pg_exec(srv.dsn, "SELECT id, aid FROM pledges ORDER BY id", None),
                       pg_exec(srv.dsn, "SELECT pid, state FROM probes ORDER BY id", None))
    assert answers["p"] == answers["y"]
    assert states["p"][:2] == states["y"][:2], "the database differs after the same calls"
    for tag in ("y", "p"):
        assert [state for _pid, state in states[tag][2]] == [""] * 6, (tag, states[tag][2])
    pids = {pid for pid, _state in states["p"][2]}
    assert len(pids) == 1, f"the plane's probes ran on one session (one connection, one thread, its pool): {pids}"
    accounts = dict((r[0], r[1]) for r in states["p"][0][0])
    assert accounts[4] == 400 + 7 and accounts[6] == 600 + 3 and states["p"][1] == [(2, 5)]
    time.sleep(1.5)
    runs = {**_history(srv, "probe"), **_history(srv, "stateful"), **_history(srv, "pledge"),
            **_history(srv, "deposit"), **_history(srv, "open_account")}
    assert all(runs[f"sp{i}"]["served_by"] == "plane" for i in range(len(calls))), \
        [(c, runs[f"sp{i}"]["served_by"]) for i, c in enumerate(calls)]
