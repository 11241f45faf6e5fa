"""The response cache in the shared segment (issue 17; shm/LAYOUT.md [Response cache]; docs/api.md "Response
cache") through a real `qag serve` with 2 workers on PostgreSQL: an answer one worker made is a hit on the other
(the cache is the host's, not a worker's); a masked key never gets an unmasked key's answer while keys with the same
masking share one; a publish makes the next call a miss; If-None-Match gives 304; concurrent misses of one key run
the statement once; the administrators' routes list and evict (scoped keys 403, evictions audit-logged); the byte
bound holds under many distinct parameter values; a QAG_RESPONSE_CACHE_MB too large for QAG_SHM_SIZE stops the
start naming both."""
from __future__ import annotations

import concurrent.futures
import json
import os
import subprocess
import sys
import time

import pytest
import requests

from tests.conftest import ROOT, free_port, pg_exec, pg_fresh_db, start_server

DB = "qag_cache_e2e"
J = {"Content-Type": "application/json"}


@pytest.fixture(scope="module")
def dsn():
    d = pg_fresh_db(DB)
    pg_exec(d, "CREATE TABLE people (id int PRIMARY KEY, name text, secret text)")
    pg_exec(d, "INSERT INTO people SELECT g, 'name' || g, 'secret' || g FROM generate_series(1, 50) g")
    return d


def post(srv, path, body, method="POST"):
    r = requests.request(method, srv.base + path, headers={**srv.admin, **J}, data=json.dumps(body), timeout=30)
    assert r.status_code in (200, 201), r.text
    return r.json()


def watcher_current(srv, timeout=20.0):
    """Until this host's change watcher is caught up (W2): before, every generation is bumped every 0.2 s (W4),
    so every answer is a miss."""
    deadline = time.monotonic() + timeout
    while "qag_change_watcher_current 1.0" not in requests.get(srv.base + "/metrics", timeout=30).text:
        assert time.monotonic() < deadline, "the change watcher never caught up"
        time.sleep(0.1)
    time.sleep(0.6)  # its catch-up's last bump (W3) is behind us


def key(srv, name, **grants):
    return {"X-API-Key": post(srv, "/api/v1/api-keys", {"name": name, **grants})["secret"]}


@pytest.fixture(scope="module")
def srv(dsn):
    s = start_server({"QAG_RESPONSE_CACHE_MB": "4"}, args=("--workers", "2"))
    post(s, "/api/v1/connections", {"name": "pg", "db": "postgres", "host": "127.0.0.1", "port": 5432,
                                    "user": "postgres", "database": DB, "options": {"allow_superuser": True}})
    for name, sql, ttl in (("person", "SELECT id, name, secret FROM people WHERE id = :id", 600),
                           ("everyone", "SELECT id, name, secret FROM people ORDER BY id", 600),
                           ("slow", "SELECT id, name FROM people, pg_sleep(0.6) WHERE id = :id", 600),
                           ("uncached", "SELECT id, name FROM people WHERE id = :id", None)):
        post(s, "/api/v1/queries", {"name": name, "connection_name": "pg", "sql": sql, "publish": True,
                                    "parameters": {"id": "int"} if ":id" in sql else {},
                                    **({"cache_ttl": ttl} if ttl else {})})
    watcher_current(s)
    yield s
    s.stop()


def fresh_get(srv, path, headers):
    """One call on a new connection (so the two workers share the calls), closed after it."""
    with requests.Session() as s:
        return s.get(srv.base + path, headers={**headers, "Connection": "close"}, timeout=30)


def history(srv, query, n, timeout=15.0):
    deadline = time.monotonic() + timeout
    while True:
        r = requests.get(srv.base + f"/api/v1/history?query={query}&limit=500", headers=srv.admin, timeout=30)
        items = r.json()["items"]
        if len(items) >= n or time.monotonic() > deadline:
            return items
        time.sleep(0.2)


def test_an_answer_made_by_one_worker_is_a_hit_on_the_other(srv):
    k = key(srv, "shared", queries=["person"])
    first = fresh_get(srv, "/q/person?id=7", k)
    assert first.status_code == 200 and first.headers["X-Cache"] == "miss", first.text
    calls = 1
    workers: set[str] = set()
    while len(workers) < 2:
        r = fresh_get(srv, "/q/person?id=7", k)
        calls += 1
        assert r.headers["X-Cache"] == "hit", f"call {calls} was a {r.headers['X-Cache']}: the cache is per worker"
        assert r.json() == first.json() and r.headers["ETag"] == first.headers["ETag"]
        if calls % 10 == 0:
            runs = history(srv, "person", calls)
            workers = {run["served_by"] for run in runs}
        assert calls < 200, f"every call went to {workers}"
    assert all(w.startswith("worker:") for w in workers)


def test_masked_key_never_gets_an_unmasked_answer_and_equal_masking_shares(srv):
    mask = [{"column": "people.secret", "action": "null"}]
    masked = key(srv, "masked1", queries=["everyone"], mask=mask)
    masked2 = key(srv, "masked2", queries=["everyone"], mask=mask)
    plain = key(srv, "plain1", queries=["everyone"])
    r = fresh_get(srv, "/q/everyone?page_size=5", plain)
    assert r.headers["X-Cache"] == "miss" and r.json()[0]["secret"] == "secret1"
    r = fresh_get(srv, "/q/everyone?page_size=5", masked)
    assert r.headers["X-Cache"] == "miss", "a masked key was answered from an unmasked key's entry"
    assert [row["secret"] for row in r.json()] == [None] * 5
    r2 = fresh_get(srv, "/q/everyone?page_size=5", masked2)
    assert r2.headers["X-Cache"] == "hit" and r2.json() == r.json(), "keys with the same masking share an entry"
    for _ in range(5):
        assert fresh_get(srv, "/q/everyone?page_size=5", masked).json() == r.json()
        assert fresh_get(srv, "/q/everyone?page_size=5", plain).json()[0]["secret"] == "secret1"
    listed = requests.get(srv.base + "/api/v1/cache?query=everyone", headers=srv.admin, timeout=30).json()["items"]
    assert len({e["masking"] for e in listed if e["page_size"] == 5}) == 2


def test_page_format_and_max_rows_are_in_the_key(srv):
    k = key(srv, "pager", queries=["everyone"])
    small = key(srv, "small", queries=["everyone"], max_rows=3)
    a = fresh_get(srv, "/q/everyone?page_size=4", k)
    b = fresh_get(srv, "/q/everyone?page_size=4&page=2", k)
    c = fresh_get(srv, "/q/everyone?page_size=4&format=csv", k)
    assert [x.headers["X-Cache"] for x in (a, b, c)] == ["miss"] * 3
    assert a.json()[0]["id"] == 1 and b.json()[0]["id"] == 5 and c.text.startswith("id,name,secret")
    d = fresh_get(srv, "/q/everyone?page_size=4", small)  # max_rows 3: page size 3, another key
    assert d.headers["X-Page-Size"] == "3" and len(d.json()) == 3 and d.headers["X-Cache"] == "miss"
    e = fresh_get(srv, "/q/everyone?page_size=4&page=2", k)
    assert e.headers["X-Cache"] == "hit" and e.json() == b.json() and e.headers["X-Page"] == "2"
    assert e.headers["X-Row-Count"] == "4" and e.headers["X-Has-More"] == "true"


def test_a_publish_makes_the_next_call_a_miss(srv):
    post(srv, "/api/v1/queries", {"name": "versioned", "connection_name": "pg", "cache_ttl": 600, "publish": True,
                                  "sql": "SELECT name FROM people WHERE id = 1"})
    k = key(srv, "pub", queries=["versioned"])
    assert fresh_get(srv, "/q/versioned", k).headers["X-Cache"] == "miss"
    assert fresh_get(srv, "/q/versioned", k).headers["X-Cache"] == "hit"
    post(srv, "/api/v1/queries/versioned/versions", {"sql": "SELECT upper(name) AS name FROM people WHERE id = 1",
                                                     "publish": True})
    r = fresh_get(srv, "/q/versioned", k)
    assert r.headers["X-Cache"] == "miss" and r.json() == [{"name": "NAME1"}]
    assert fresh_get(srv, "/q/versioned", k).json() == [{"name": "NAME1"}]


def test_if_none_match_gives_304_without_a_body(srv):
    k = key(srv, "cond", queries=["person"])
    first = fresh_get(srv, "/q/person?id=9", k)
    etag = first.headers["ETag"]
    assert first.headers["Cache-Control"] == "private, max-age=600" and etag.startswith('"') and len(etag) == 34
    r = fresh_get(srv, "/q/person?id=9", {**k, "If-None-Match": etag})
    assert r.status_code == 304 and r.content == b"" and r.headers["ETag"] == etag
    r = fresh_get(srv, "/q/person?id=9", {**k, "If-None-Match": '"nope", W/' + etag})
    assert r.status_code == 304
    r = fresh_get(srv, "/q/person?id=9", {**k, "If-None-Match": '"nope"'})
    assert r.status_code == 200 and r.json() == first.json()
    plain = key(srv, "cond2", queries=["uncached"])
    r = fresh_get(srv, "/q/uncached?id=9", {**plain, "If-None-Match": "*"})
    assert r.status_code == 200 and "X-Cache" not in r.headers and r.headers["Cache-Control"] == "no-store"


def test_concurrent_misses_of_one_key_run_the_statement_once(srv):
    """R13: eight callers at once on a 0.6 s statement: one fills, seven wait for its answer."""
    k = key(srv, "herd", queries=["slow"])
    with concurrent.futures.ThreadPoolExecutor(8) as ex:
        out = list(ex.map(lambda _: fresh_get(srv, "/q/slow?id=3", k), range(8)))
    assert all(r.status_code == 200 for r in out), [r.text for r in out]
    assert sorted(r.headers["X-Cache"] for r in out) == ["hit"] * 7 + ["miss"]
    metrics = requests.get(srv.base + "/metrics", timeout=30).text
    waited = [line for line in metrics.splitlines() if line.startswith('qag_response_cache_total{result="waited"}')]
    assert waited and float(waited[0].split()[-1]) >= 1, metrics


def test_admin_routes_list_and_evict(srv):
    k = key(srv, "adm", queries=["person", "everyone"])
    for i in (1, 2, 3):
        fresh_get(srv, f"/q/person?id={i}", k)
    fresh_get(srv, "/q/everyone?page_size=2", k)
    r = requests.get(srv.base + "/api/v1/cache", headers=k, timeout=30)
    assert r.status_code == 403 and r.json()["code"] == "forbidden"
    assert requests.delete(srv.base + "/api/v1/cache", headers=k, timeout=30).status_code == 403
    body = requests.get(srv.base + "/api/v1/cache?query=person", headers=srv.admin, timeout=30).json()
    people = body["items"]
    assert len(people) >= 3 and {e["query"] for e in people} == {"person"}
    e = people[0]
    assert (e["version"], e["connection"], e["format"], e["page"], e["page_size"]) == (1, "pg", "json", 1, 10)
    assert e["bytes"] > e["body_bytes"] > 0 and 0 < e["ttl_left_s"] <= 600 and e["fresh"] and e["hits"] >= 0
    t = body["totals"]
    assert t["enabled"] and t["entries"] >= 4 and 0 < t["bytes_used"] <= t["capacity_bytes"]
    r = requests.delete(srv.base + "/api/v1/cache/person", headers=srv.admin, timeout=30)
    assert r.status_code == 200 and r.json()["evicted"] >= 3, r.text
    assert fresh_get(srv, "/q/person?id=1", k).headers["X-Cache"] == "miss"
    assert fresh_get(srv, "/q/everyone?page_size=2", k).headers["X-Cache"] == "hit"  # another query's stayed
    for path, code in (("/api/v1/cache?query=", "invalid_body"), ("/api/v1/cache?qeury=person", "unknown_field"),
                       ("/api/v1/cache/everyone?all=1", "unknown_field")):  # refused: nothing evicted
        r = requests.delete(srv.base + path, headers=srv.admin, timeout=30)
        assert r.status_code == 400 and r.json()["code"] == code, (path, r.text)
    r = requests.get(srv.base + "/api/v1/cache?qeury=person", headers=srv.admin, timeout=30)
    assert r.status_code == 400 and r.json()["code"] == "unknown_field", r.text
    assert fresh_get(srv, "/q/everyone?page_size=2", k).headers["X-Cache"] == "hit"
    r = requests.delete(srv.base + "/api/v1/cache", headers=srv.admin, timeout=30)
    assert r.status_code == 200 and r.json()["evicted"] >= 2 and r.json()["totals"]["entries"] == 0
    assert fresh_get(srv, "/q/everyone?page_size=2", k).headers["X-Cache"] == "miss"
    r = requests.delete(srv.base + "/api/v1/cache/nosuchquery", headers=srv.admin, timeout=30)
    assert r.status_code == 404 and r.json()["code"] == "query_not_found"
    audit = requests.get(srv.base + "/api/v1/audit", headers=srv.admin, timeout=30).json()["items"]
    evictions = [a for a in audit if a["entity"] == "response_cache"]
    assert [(a["action"], a["name"]) for a in evictions[:2]] == [("evict", "*"), ("evict", "person")]
    metrics = requests.get(srv.base + "/metrics", timeout=30).text
    for name in ("qag_response_cache_total{result=\"hit\"}", "qag_response_cache_bytes",
                 "qag_response_cache_capacity_bytes", "qag_response_cache_evictions_total{cause=\"removed\"}"):
        assert name in metrics, name


def test_the_byte_bound_holds_with_many_distinct_parameters(dsn):
    """1 MiB of response cache, 1,500 answers of about 2 KiB: the oldest go, the newest stay, the bytes held
    never pass the arena."""
    s = start_server({"QAG_RESPONSE_CACHE_MB": "1"}, args=("--workers", "2"))
    try:
        post(s, "/api/v1/connections", {"name": "pg", "db": "postgres", "host": "127.0.0.1", "port": 5432,
                                        "user": "postgres", "database": DB, "options": {"allow_superuser": True}})
        post(s, "/api/v1/queries", {"name": "wide", "connection_name": "pg", "cache_ttl": 600, "publish": True,
                                    "parameters": {"i": "int"}, "sql": "SELECT :i AS i, repeat('x', 2000) AS pad"})
        watcher_current(s)
        k = key(s, "wide", queries=["wide"])
        with requests.Session() as sess:
            for i in range(1500):
                r = sess.get(s.base + f"/q/wide?i={i}", headers=k, timeout=30)
                assert r.status_code == 200 and r.headers["X-Cache"] == "miss"
            t = requests.get(s.base + "/api/v1/cache?limit=1000", headers=s.admin, timeout=30).json()["totals"]
            assert t["bytes_used"] <= t["capacity_bytes"] < 1 << 20 and t["evictions"] > 0
            assert 300 < t["entries"] < 1500
            assert sess.get(s.base + "/q/wide?i=1499", headers=k, timeout=30).headers["X-Cache"] == "hit"
            assert sess.get(s.base + "/q/wide?i=0", headers=k, timeout=30).headers["X-Cache"] == "miss"
    finally:
        s.stop()


def test_a_response_cache_too_large_for_the_segment_stops_the_start(tmp_path):
    env = {"QAG_HOME": str(tmp_path), "QAG_RESPONSE_CACHE_MB": "40", "QAG_BIND": f"127.0.0.1:{free_port()}",
           "QAG_ADMIN_KEY": "adm-x"}
    p = subprocess.run([sys.executable, "-m", "qag.cli", "serve", "--workers", "1"], env={**os.environ, **env},
                       capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert p.returncode != 0
    out = p.stdout + p.stderr
    assert "QAG_RESPONSE_CACHE_MB=40" in out and "QAG_SHM_SIZE" in out, out


def test_a_small_segment_alone_starts_with_the_cache_that_fits(tmp_path):
    """QAG_RESPONSE_CACHE_MB's default (auto) takes 16 MiB or what a smaller QAG_SHM_SIZE leaves: an operator who
    only shrinks the segment is not stopped by a setting they never set."""
    s = start_server({"QAG_SHM_SIZE": str(4 << 20)}, args=("--workers", "1"))
    try:
        t = requests.get(s.base + "/api/v1/cache", headers=s.admin, timeout=30).json()["totals"]
        assert t["enabled"] and 0 < t["capacity_bytes"] <= 1 << 20, t
    finally:
        s.stop()
    s = start_server({"QAG_SHM_SIZE": str(1 << 20)}, args=("--workers", "1"))
    try:
        assert requests.get(s.base + "/health", timeout=30).status_code == 200
    finally:
        s.stop()
