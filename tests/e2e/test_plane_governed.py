"""The plane refuses what Python refused (issue 12), through `qag serve --plane`: every call is made through the
plane (the public port) and straight to gunicorn's socket, and the two answers must be identical.

- Drafts: `?version=N` is always Python's to answer (a scoped key gets 404 `version_not_found` for any version
  but the published one), and a call with `version` never changes what the plane serves afterwards: plan
  entries are published for the published version only (shm/LAYOUT.md [Plan entry], P2).
- Refused governance: a plan governance refuses is never published, so the plane has nothing to serve: a
  masked key on `row_to_json(c)` gets Python's refusal through the plane, never a 200.
"""
from __future__ import annotations

import json
import os
import time

import pytest
import requests

from tests.conftest import pg_exec, pg_fresh_db, start_server
from tests.e2e.test_plane_differential import UnixConn, _call

pytestmark = pytest.mark.usefixtures("plane")  # built by `make plane`, never under a test timeout


@pytest.fixture(scope="module")
def stack():
    dsn = pg_fresh_db("qag_rust_gov")
    pg_exec(dsn, "CREATE TABLE customers (id int PRIMARY KEY, name text, email text)", None)
    pg_exec(dsn, "INSERT INTO customers SELECT i, 'name' || i, 'user' || i || '@example.com' "
                 "FROM generate_series(1, 20) i", None)
    srv = start_server({"QAG_WORKERS": "1"}, args=("--workers", "1", "--plane", "--plane-threads", "1"))
    adm = {**srv.admin, "Content-Type": "application/json"}

    def post(path, body):
        r = requests.post(srv.base + path, json=body, headers=adm, timeout=30)
        assert r.status_code in (200, 201), (path, r.status_code, r.text)
        return r.json()
    post("/api/v1/connections", {"name": "gov_pg", "db": "postgres", "host": "127.0.0.1", "port": 5432,
                                 "user": "postgres", "database": "qag_rust_gov"})
    post("/api/v1/queries", {"name": "who", "connection_name": "gov_pg", "publish": True,
                             "sql": "SELECT id, name FROM customers WHERE id = :id", "parameters": {"id": "int"}})
    post("/api/v1/queries/who/versions", {"sql": "SELECT id, 'DRAFT' AS name FROM customers WHERE id = :id",
                                          "parameters": {"id": "int"}})
    post("/api/v1/queries", {"name": "whole_row", "connection_name": "gov_pg", "publish": True,
                             "sql": "SELECT row_to_json(c) AS r FROM customers c WHERE id = :id",
                             "parameters": {"id": "int"}})
    srv.keys = {
        "plain": post("/api/v1/api-keys",
                      {"name": "rust_plain", "queries": ["*"], "connections": ["gov_pg"]})["secret"],
        "masked": post("/api/v1/api-keys", {"name": "rust_masked", "queries": ["*"], "connections": ["gov_pg"],
                                            "mask": [{"column": "customers.email", "action": "mask"}]})["secret"],
    }
    srv.sock = os.path.join(srv.env["QAG_HOME"], "gunicorn.sock")
    srv.port = int(srv.base.rsplit(":", 1)[1])
    yield srv
    srv.stop()


def _both(srv, path: str, who: str, rid: str):
    import http.client
    plane = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=30)
    direct = UnixConn(srv.sock)
    out = []
    try:
        # "-p" through the plane, "-y" straight to Python: ids of one length, so Content-Length agrees
        for conn, r in ((plane, rid + "-p"), (direct, rid + "-y")):
            status, body, headers = _call(conn, path, {"X-API-Key": srv.keys[who], "X-Request-Id": r})
            assert headers.pop("x-request-id", None) == r
            out.append((status, body.replace(r.encode(), b"<rid>"), headers))
    finally:
        plane.close()
        direct.close()
    return out[0], out[1]


def _served_by(srv, query: str, rids: list[str], timeout: float = 15) -> dict[str, str]:
    deadline = time.time() + timeout
    while True:
        r = requests.get(srv.base + "/api/v1/history", params={"query": query, "limit": 1000}, headers=srv.admin,
                         timeout=30)
        assert r.status_code == 200, r.text
        runs = {run["request_id"][:-2]: run["served_by"] for run in r.json()["items"]
                if run["request_id"].endswith("-p")}
        if all(x in runs for x in rids) or time.time() > deadline:
            return runs
        time.sleep(0.3)


def _same(a, b):
    """Status, body and headers equal, timing headers and request ids aside (the differential test's rule)."""
    assert (a[0], a[1], a[2]) == (b[0], b[1], b[2]), (a, b)


def test_a_version_call_never_changes_what_the_plane_serves(stack):
    srv = stack
    for i in range(3):  # the plan of the published version is in the segment: the plane serves it
        _same(*_both(srv, "/q/who?id=1", "plain", f"pub{i}"))
    a, b = _both(srv, "/q/who?id=1&version=2", "plain", "draft")
    _same(a, b)
    for i in range(5):  # afterwards, calls without `version` still get the published version, from the plane
        a, b = _both(srv, "/q/who?id=1", "plain", f"after{i}")
        _same(a, b)
        assert a[0] == 200 and json.loads(a[1]) == [{"id": 1, "name": "name1"}], a
    runs = _served_by(srv, "who", ["draft"] + [f"after{i}" for i in range(5)])
    assert runs["draft"].startswith("worker"), "a call with version is Python's"
    assert all(runs.get(f"after{i}") == "plane" for i in range(5)), runs


def test_a_scoped_key_gets_version_not_found_for_a_draft_through_the_plane(stack):
    srv = stack
    a, b = _both(srv, "/q/who?id=1&version=2", "plain", "draft404")
    _same(a, b)
    assert a[0] == 404 and json.loads(a[1])["code"] == "version_not_found", a


def test_a_masked_key_on_a_whole_row_is_refused_through_the_plane(stack):
    srv = stack
    rids = []
    for i in range(4):  # the first call would publish an approved plan; the next ones would be the plane's
        a, b = _both(srv, "/q/whole_row?id=1", "masked", f"row{i}")
        _same(a, b)
        assert a[0] != 200, a
        assert b"user1@example.com" not in a[1] and b"ser1@example.com" not in a[1], a
        rids.append(f"row{i}")
    runs = _served_by(srv, "whole_row", rids)
    assert not [r for r in rids if runs.get(r) == "plane"], runs


def test_timeout_is_pythons_to_clamp_or_refuse_through_the_plane(stack):
    """issue 13 item 4: a call with `timeout` is forwarded, so the plane answers exactly as Python clamps
    (0.0004 s runs with 10 ms, never with no limit) or refuses (400 invalid_timeout)."""
    srv = stack
    for i, (t, status) in enumerate((("0.0004", 200), ("0", 400), ("-1", 400), ("abc", 400), ("1e9", 200))):
        a, b = _both(srv, f"/q/who?id=1&timeout={t}", "plain", f"to{i}")
        _same(a, b)
        assert a[0] == status, (t, a)
        if status == 400:
            assert json.loads(a[1])["code"] == "invalid_timeout", (t, a)
    runs = _served_by(srv, "who", [f"to{i}" for i in (0, 4)])
    assert runs.get("to0", "").startswith("worker") and runs.get("to4", "").startswith("worker"), runs


def test_a_postgres_on_another_host_is_pythons(stack):
    """libpq's default sslmode is `prefer`: Python's sessions to a PostgreSQL beyond this host are encrypted when the
    server offers TLS, the plane's are plain TCP; so the plane serves only databases it reaches on loopback, as it
    does for MySQL. A host named by something other than `localhost` or a loopback address is another host to the
    plane (this machine's own name, resolving to 127.x here, stands in for one: Python still reaches it)."""
    import socket
    name = socket.gethostname()
    try:
        loop = socket.gethostbyname(name).startswith("127.")
    except OSError:
        loop = False
    if not loop or name.lower() == "localhost":
        pytest.skip("this machine's name does not resolve to a loopback address")
    srv = stack
    adm = {**srv.admin, "Content-Type": "application/json"}
    for path, body in (
            ("/api/v1/connections", {"name": "gov_pg_named", "db": "postgres", "host": name, "port": 5432,
                                     "user": "postgres", "database": "qag_rust_gov"}),
            ("/api/v1/queries", {"name": "who_named", "connection_name": "gov_pg_named", "publish": True,
                                 "sql": "SELECT id, name FROM customers WHERE id = :id",
                                 "parameters": {"id": "int"}}),
            ("/api/v1/api-keys", {"name": "rust_named", "queries": ["*"],
                                  "connections": ["gov_pg", "gov_pg_named"]})):
        r = requests.post(srv.base + path, json=body, headers=adm, timeout=30)
        assert r.status_code == 201, r.text
        if path.endswith("api-keys"):
            srv.keys["named"] = r.json()["secret"]
    rids = []
    for i in range(4):  # the first call publishes the plan; had the plane served its connection, the rest were its
        a, b = _both(srv, "/q/who_named?id=2", "named", f"nam{i}")
        _same(a, b)
        assert a[0] == 200 and json.loads(a[1]) == [{"id": 2, "name": "name2"}], a
        rids.append(f"nam{i}")
    runs = _served_by(srv, "who_named", rids)
    assert all(runs.get(r, "").startswith("worker") for r in rids), runs
    for i in range(3):  # the same key on the loopback connection: the plane's
        _both(srv, "/q/who?id=2", "named", f"lbk{i}")
    runs = _served_by(srv, "who", [f"lbk{i}" for i in range(1, 3)])
    assert all(runs.get(f"lbk{i}") == "plane" for i in range(1, 3)), runs
