"""The contract's readings of a call hold whichever process answers it: with `qag serve --plane`, a GET /q the data
plane serves itself reads page/page_size and parameter text in Python's grammar, and a GET with a body goes to
Python, which refuses it (400 invalid_body), instead of being served with its body ignored."""
from __future__ import annotations

import time

import pytest
import requests

from tests.conftest import PG_ADMIN_DSN, need_plane, pg_exec, pg_fresh_db, start_server

DB = "qag_http_contract_plane"
J = {"Content-Type": "application/json"}


@pytest.fixture(scope="module")
def srv():
    need_plane()
    dsn = pg_fresh_db(DB)
    pg_exec(dsn, "CREATE TABLE t (id int PRIMARY KEY, v text)")
    pg_exec(dsn, "INSERT INTO t SELECT g, 'v' || g FROM generate_series(1, 30) g")
    s = start_server(args=("--workers", "1", "--plane", "--plane-threads", "1"))
    try:
        def post(path, body):
            r = requests.post(s.base + path, json=body, headers={**s.admin, **J}, timeout=30)
            assert r.status_code in (200, 201), r.text
            return r.json()
        post("/api/v1/connections", {"name": "pg", "db": "postgres", "host": "127.0.0.1", "port": 5432,
                                     "user": "postgres", "database": DB})
        post("/api/v1/queries", {"name": "rows", "connection_name": "pg", "publish": True,
                                 "sql": "SELECT id, v FROM t WHERE id >= :start ORDER BY id",
                                 "parameters": {"start": "int"}})
        s.key = {"X-API-Key": post("/api/v1/api-keys", {"name": "k", "queries": ["rows"]})["secret"]}
        deadline = time.monotonic() + 20
        while "qag_change_watcher_current 1.0" not in requests.get(s.base + "/metrics", timeout=30).text:
            assert time.monotonic() < deadline, "the change watcher never caught up"
            time.sleep(0.1)
        yield s
    finally:
        s.stop()
        pg_exec(PG_ADMIN_DSN, f"DROP DATABASE IF EXISTS {DB} WITH (FORCE)")


def served_by(srv, rid: str, timeout=15.0) -> str | None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        r = requests.get(srv.base + "/api/v1/history", params={"query": "rows", "limit": 1000},
                         headers=srv.admin, timeout=30)
        for it in r.json()["items"]:
            if it["request_id"] == rid:
                return it["served_by"]
        time.sleep(0.2)
    return None


def test_the_plane_serves_plain_calls(srv):
    for i in range(5):  # the first calls publish the key's and the plan's entries
        r = requests.get(srv.base + "/q/rows?start=1&page_size=2", headers={**srv.key, "X-Request-Id": f"warm{i}"})
        assert r.json() == [{"id": 1, "v": "v1"}, {"id": 2, "v": "v2"}]
    assert served_by(srv, "warm4") == "plane"


@pytest.mark.parametrize("qs, code", [
    ("start=1&page=1_0", "invalid_paging"), ("start=1&page=%201", "invalid_paging"),
    ("start=1&page_size=2%20", "invalid_paging"), ("start=%201", "param_invalid"), ("start=1%09", "param_invalid"),
])
def test_a_value_outside_the_grammar_is_refused_by_the_plane_as_by_python(srv, qs, code):
    r = requests.get(f"{srv.base}/q/rows?{qs}", headers=srv.key)
    assert r.status_code == 400 and r.json()["code"] == code, r.text  # page=1_0 was served as page 10


def test_a_get_with_a_body_goes_to_python_and_is_refused(srv):
    r = requests.get(srv.base + "/q/rows?start=1", headers={**srv.key, **J, "X-Request-Id": "with-body"},
                     data=b'{"params": {"start": 29}}')
    assert r.status_code == 400 and r.json()["code"] == "invalid_body", r.text
