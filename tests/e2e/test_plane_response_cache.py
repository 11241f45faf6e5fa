"""The Rust data plane serves the response cache's hits (issue 17 part 2; shm/LAYOUT.md [Response cache] R5, R9,
R15): through `qag serve --plane` on PostgreSQL, a call of a query with cache_ttl whose answer Python cached is
answered by the plane (its run says `served_by: plane`) with the bytes and headers of Python's own hit (status,
body, ETag, Cache-Control, X-Cache, paging headers, the CSV download name), 304 on a matching If-None-Match, and
recorded like Python's hit (rows, body bytes; 0 for a 304). A miss goes to Python, which fills the cache. A masked
key never gets an unmasked key's answer: its key carries its masking fingerprint, so it misses, and its own hit
is masked."""
from __future__ import annotations

import http.client
import os
import sqlite3
import time

import pytest
import requests

from tests.conftest import need_plane, pg_exec, pg_fresh_db, start_server
from tests.e2e.test_plane_differential import IGNORED_HEADERS, UnixConn

DB = "qag_plane_cache_e2e"
J = {"Content-Type": "application/json"}


def post(srv, path, body):
    r = requests.post(srv.base + path, json=body, headers={**srv.admin, **J}, timeout=30)
    assert r.status_code in (200, 201), (path, r.status_code, r.text)
    return r.json()


@pytest.fixture(scope="module")
def stack():
    need_plane()
    dsn = pg_fresh_db(DB)
    pg_exec(dsn, "CREATE TABLE people (id int PRIMARY KEY, name text, email text, score numeric(6,2))")
    pg_exec(dsn, "INSERT INTO people SELECT g, 'name ' || g || CASE WHEN g % 4 = 0 THEN ', \"q\"' ELSE '' END, "
                 "'user' || g || '@example.com', g * 1.25 FROM generate_series(1, 60) g", None)  # no args: % is literal
    srv = start_server({"QAG_MASK_KEY": "plane-cache-mask", "QAG_RESPONSE_CACHE_MB": "4"},
                       args=("--workers", "1", "--plane", "--plane-threads", "2"))
    post(srv, "/api/v1/connections", {"name": "pg", "db": "postgres", "host": "127.0.0.1", "port": 5432,
                                      "user": "postgres", "database": DB, "options": {"allow_superuser": True}})
    post(srv, "/api/v1/queries", {"name": "people", "connection_name": "pg", "publish": True, "cache_ttl": 600,
                                  "sql": "SELECT id, name, email, score FROM people WHERE id >= :lo ORDER BY id",
                                  "parameters": {"lo": {"type": "int", "default": 1}}})
    srv.keys = {
        "plain": post(srv, "/api/v1/api-keys", {"name": "plain", "queries": ["*"], "connections": ["pg"]})["secret"],
        "gov": post(srv, "/api/v1/api-keys", {"name": "gov", "queries": ["*"], "connections": ["pg"],
                                              "mask": [{"column": "people.email", "action": "hash"}]})["secret"],
    }
    srv.sock = srv.env["QAG_HOME"] + "/gunicorn.sock"
    srv.port = int(srv.base.rsplit(":", 1)[1])
    # before the change watcher has caught up, every generation moves every 0.2 s: every answer would be a miss
    deadline = time.monotonic() + 20
    while "qag_change_watcher_current 1.0" not in requests.get(srv.base + "/metrics", timeout=30).text:
        assert time.monotonic() < deadline, "the change watcher never caught up"
        time.sleep(0.1)
    time.sleep(0.6)
    yield srv
    srv.stop()


def call(conn, path, key, rid, extra=None):
    conn.request("GET", path, headers={"X-API-Key": key, "X-Request-Id": rid, **(extra or {})})
    r = conn.getresponse()
    body = r.read()
    headers = {k.lower(): v for k, v in r.getheaders() if k.lower() not in IGNORED_HEADERS}
    assert headers.pop("x-request-id") == rid
    return r.status, body, headers


def runs(srv, rids, timeout=15.0):
    """The run records of these request ids (the recorder batches: wait until all are there)."""
    deadline = time.monotonic() + timeout
    while True:
        r = requests.get(srv.base + "/api/v1/history", params={"query": "people", "limit": 1000},
                         headers=srv.admin, timeout=30)
        assert r.status_code == 200, r.text
        got = {it["request_id"]: it for it in r.json()["items"] if it["request_id"] in rids}
        if len(got) == len(rids) or time.monotonic() > deadline:
            return got
        time.sleep(0.2)


def sent_bytes(srv, rids) -> dict[str, int]:
    """Each run's `bytes` (the history API does not show them): from the instance's own run store."""
    db = sqlite3.connect(os.path.join(srv.env["QAG_HOME"], "runs.db"))
    try:
        marks = ",".join("?" * len(rids))
        return dict(db.execute(f"SELECT request_id, bytes FROM qag_history WHERE request_id IN ({marks})",
                               list(rids)).fetchall())
    finally:
        db.close()


@pytest.mark.parametrize("fmt", ["json", "csv", "ndjson"])
def test_a_hit_served_by_the_plane_is_pythons_hit(stack, fmt):
    srv = stack
    plane, direct = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=30), UnixConn(srv.sock)
    path = f"/q/people?lo=7&page_size=5&format={fmt}"
    key = srv.keys["plain"]
    miss = call(direct, path, key, f"{fmt}-fill")       # Python: a miss, which it stores
    assert miss[0] == 200 and miss[2]["x-cache"] == "miss", miss
    py_hit = call(direct, path, key, f"{fmt}-py-hit")   # Python's own hit
    assert py_hit[0] == 200 and py_hit[2]["x-cache"] == "hit", py_hit
    rids = [f"{fmt}-plane-{i}" for i in range(3)]
    for rid in rids:
        got = call(plane, path, key, rid)
        assert got == py_hit, (got, py_hit)             # status, body and headers: Python's hit, byte for byte
    etag = py_hit[2]["etag"]
    for inm in (etag, f'W/{etag}, "other"', "*"):
        py_304 = call(direct, path, key, f"{fmt}-py-304", {"If-None-Match": inm})
        got = call(plane, path, key, f"{fmt}-plane-304", {"If-None-Match": inm})
        assert got[0] == 304 and got[1] == b"" and got == py_304, (inm, got, py_304)
    got = call(plane, path, key, f"{fmt}-plane-other", {"If-None-Match": '"0123"'})
    assert got == py_hit
    recorded = runs(srv, set(rids) | {f"{fmt}-plane-304", f"{fmt}-py-hit"})
    sent = sent_bytes(srv, recorded)
    for rid in rids:
        run = recorded[rid]
        assert run["served_by"] == "plane", run  # the plane answered it, not Python
        assert (run["status"], run["rows"], sent[rid]) == (200, 5, len(py_hit[1])), run
    py = recorded[f"{fmt}-py-hit"]
    assert py["served_by"].startswith("worker") and (py["rows"], sent[f"{fmt}-py-hit"]) == (5, len(py_hit[1])), py
    run = recorded[f"{fmt}-plane-304"]
    assert (run["served_by"], run["status"], run["rows"], sent[f"{fmt}-plane-304"]) == ("plane", 304, 5, 0), run


def test_a_miss_goes_to_python_which_fills_the_cache(stack):
    srv = stack
    plane = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=30)
    key = srv.keys["plain"]
    first = call(plane, "/q/people?lo=31", key, "miss-1")
    second = call(plane, "/q/people?lo=31", key, "miss-2")
    assert first[2]["x-cache"] == "miss" and second[2]["x-cache"] == "hit" and first[1] == second[1]
    recorded = runs(srv, {"miss-1", "miss-2"})
    assert recorded["miss-1"]["served_by"].startswith("worker"), recorded
    assert recorded["miss-2"]["served_by"] == "plane", recorded


def test_a_masked_key_never_gets_an_unmasked_answer(stack):
    srv = stack
    plane, direct = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=30), UnixConn(srv.sock)
    path = "/q/people?lo=40&page_size=3"
    plain = [call(plane, path, srv.keys["plain"], f"plain-{i}") for i in range(3)]  # cached, then hits
    assert plain[-1][2]["x-cache"] == "hit" and b"@example.com" in plain[-1][1]
    gov = [call(plane, path, srv.keys["gov"], f"gov-{i}") for i in range(3)]
    assert gov[0][2]["x-cache"] == "miss", gov[0]    # not the plain key's answer: its own key (its masking)
    for status, body, _headers in gov:
        assert status == 200 and b"@example.com" not in body and body != plain[-1][1], body
    assert gov[-1][2]["x-cache"] == "hit" and gov[-1][1] == gov[0][1]
    py_gov_hit = call(direct, path, srv.keys["gov"], "gov-py")
    assert py_gov_hit[2]["x-cache"] == "hit" and gov[-1] == py_gov_hit
    recorded = runs(srv, {"gov-0", "gov-2", "plain-2"})
    assert recorded["gov-0"]["served_by"].startswith("worker"), recorded["gov-0"]
    assert recorded["gov-2"]["served_by"] == "plane" and recorded["plain-2"]["served_by"] == "plane", recorded


def test_the_plane_counts_its_hits(stack):
    srv = stack
    plane = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=30)

    def hits():
        text = requests.get(srv.base + "/metrics", timeout=30).text
        line = [ln for ln in text.splitlines() if ln.startswith('qag_response_cache_total{result="hit"}')]
        return float(line[0].split()[-1]) if line else 0.0
    call(plane, "/q/people?lo=50", srv.keys["plain"], "count-fill")
    before = hits()
    for i in range(4):
        assert call(plane, "/q/people?lo=50", srv.keys["plain"], f"count-{i}")[2]["x-cache"] == "hit"
    assert hits() - before == 4
    assert all(r["served_by"] == "plane" for r in runs(srv, {f"count-{i}" for i in range(4)}).values())
