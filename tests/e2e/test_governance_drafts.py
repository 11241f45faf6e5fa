"""Issue 12, class 8, end to end through `qag serve --plane`: only administrators run a version other than the
published one. A scoped key asking for a draft, a retired version or one that does not exist gets 404
`version_not_found` (the same answer for all three), and the Rust plane, which looks plans up by (key, query)
alone, never serves a draft either: Python publishes only the published version's plan."""
from __future__ import annotations

import time

import pytest
import requests

from tests.conftest import need_plane, pg_exec, pg_fresh_db, start_server

DB = "qag_govpolicy_drafts"


@pytest.fixture(scope="module")
def stack():
    need_plane()
    dsn = pg_fresh_db(DB)
    pg_exec(dsn, "CREATE TABLE customers (id int PRIMARY KEY, name text, email text)")
    pg_exec(dsn, "INSERT INTO customers VALUES (1, 'Ada', 'ada@example.com'), (2, 'Bob', 'bob@example.org')")
    srv = start_server({"QAG_WORKERS": "1"}, args=("--workers", "1", "--plane", "--plane-threads", "1"))
    adm = {**srv.admin, "Content-Type": "application/json"}

    def post(path, body):
        r = requests.post(srv.base + path, json=body, headers=adm, timeout=30)
        assert r.status_code in (200, 201), (path, r.status_code, r.text)
        return r.json()
    post("/api/v1/connections", {"name": "pg", "db": "postgres", "host": "127.0.0.1", "port": 5432,
                                 "user": "postgres", "database": DB})
    post("/api/v1/queries", {"name": "who", "connection_name": "pg", "sql": "SELECT id, name FROM customers "
                             "WHERE id = :id", "parameters": {"id": "int"}, "publish": True})
    # version 2 is a draft that reads the email in clear: a scoped key must never run it
    post("/api/v1/queries/who/versions", {"sql": "SELECT id, email AS name FROM customers WHERE id = :id",
                                          "parameters": {"id": "int"}})
    srv.key = post("/api/v1/api-keys", {"name": "scoped", "queries": ["who"], "connections": ["pg"]})["secret"]
    srv.post = post
    yield srv
    srv.stop()


def _get(srv, path, key, rid=None):
    h = {"X-API-Key": key}
    if rid:
        h["X-Request-Id"] = rid
    return requests.get(srv.base + path, headers=h, timeout=30)


def _run(srv, rid):
    deadline = time.time() + 10
    while time.time() < deadline:
        items = requests.get(srv.base + "/api/v1/history", params={"query": "who", "limit": 1000},
                             headers=srv.admin, timeout=30).json()["items"]
        for run in items:
            if run["request_id"] == rid:
                return run
        time.sleep(0.2)
    raise AssertionError(f"no run for {rid}")


def test_scoped_key_gets_version_not_found_for_any_other_version(stack):
    srv = stack
    answers = {}
    for v in ("2", "9"):
        r = _get(srv, f"/q/who?id=1&version={v}", srv.key)
        assert r.status_code == 404, r.text
        body = r.json()
        assert body["code"] == "version_not_found" and "ada@example.com" not in r.text
        answers[v] = body["error"].replace(v, "N")
    assert answers["2"] == answers["9"], "a draft and a missing version must read alike (no oracle)"
    # the published version by its number is fine
    r = _get(srv, "/q/who?id=1&version=1", srv.key)
    assert r.status_code == 200 and r.json() == [{"id": 1, "name": "Ada"}], r.text


def test_administrator_runs_drafts_and_gets_version_not_found_for_missing(stack):
    srv = stack
    r = requests.get(srv.base + "/q/who?id=1&version=2", headers=srv.admin, timeout=30)
    assert r.status_code == 200 and r.json() == [{"id": 1, "name": "ada@example.com"}], r.text
    r = requests.get(srv.base + "/q/who?id=1&version=9", headers=srv.admin, timeout=30)
    assert r.status_code == 404 and r.json()["code"] == "version_not_found", r.text


def test_plane_never_serves_a_draft(stack):
    """Ask for the draft first (the call Python refuses), then call plainly many times: every answer, whether
    the plane or Python gives it, is the published version's; and the plane does serve the plain calls."""
    srv = stack
    assert _get(srv, "/q/who?id=2&version=2", srv.key).status_code == 404
    served = set()
    for i in range(30):
        rid = f"drafts-plain-{i}"
        r = _get(srv, "/q/who?id=2", srv.key, rid)
        assert r.status_code == 200 and r.json() == [{"id": 2, "name": "Bob"}], r.text
        if i == 0 or i >= 25:
            served.add(_run(srv, rid)["served_by"])
    assert "plane" in served, served
    # once published, version 2 is what everyone runs, and version 1 is now an administrator's only
    srv.post("/api/v1/queries/who/publish", {"version": 2})
    r = _get(srv, "/q/who?id=2", srv.key)
    assert r.status_code == 200 and r.json() == [{"id": 2, "name": "bob@example.org"}], r.text
    assert _get(srv, "/q/who?id=2&version=1", srv.key).json()["code"] == "version_not_found"
    for _ in range(10):
        r = _get(srv, "/q/who?id=2", srv.key)
        assert r.json() == [{"id": 2, "name": "bob@example.org"}], r.text
