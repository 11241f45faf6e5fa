"""A key's and a plan's entries evicted from the segment's cache come back: a worker that still holds them warm
looks at most once a second (qag.runtime.REPUBLISH_CHECK_S) that the segment has them and puts back what is gone.
Before, Python published an entry only when its own cache missed, so after an eviction the data plane forwarded
that key's calls to Python for good (found by bench/blocks.py's keys block at 10,000 keys)."""
from __future__ import annotations

import http.client
import time

import requests

from tests.conftest import need_plane, pg_exec, pg_fresh_db, start_server

DB = "qag_plane_republish_e2e"
J = {"Content-Type": "application/json"}
OTHERS = 120  # keys called once each: 240 entries, where a 1 MiB segment holds 152 (19 sets of 8)


def post(srv, path, body):
    r = requests.post(srv.base + path, json=body, headers={**srv.admin, **J}, timeout=30)
    assert r.status_code in (200, 201), (path, r.status_code, r.text)
    return r.json()


def served_by(srv, rids, timeout=15.0) -> dict[str, str]:
    deadline = time.monotonic() + timeout
    while True:
        r = requests.get(srv.base + "/api/v1/history", params={"query": "one", "limit": 1000},
                         headers=srv.admin, timeout=30)
        got = {it["request_id"]: it["served_by"] for it in r.json()["items"] if it["request_id"] in rids}
        if len(got) == len(rids) or time.monotonic() > deadline:
            return got
        time.sleep(0.2)


def wait_watcher(srv) -> None:
    deadline = time.monotonic() + 20
    while "qag_change_watcher_current 1.0" not in requests.get(srv.base + "/metrics", timeout=30).text:
        assert time.monotonic() < deadline, "the change watcher never caught up"
        time.sleep(0.1)
    time.sleep(0.6)


def test_evicted_entries_are_published_again_and_the_plane_serves_them():
    need_plane()
    dsn = pg_fresh_db(DB)
    pg_exec(dsn, "CREATE TABLE t (id int PRIMARY KEY, v text)")
    pg_exec(dsn, "INSERT INTO t VALUES (1, 'a')")
    srv = start_server({"QAG_SHM_SIZE": str(1 << 20)}, args=("--workers", "1", "--plane", "--plane-threads", "1"))
    try:
        post(srv, "/api/v1/connections", {"name": "pg", "db": "postgres", "host": "127.0.0.1", "port": 5432,
                                          "user": "postgres", "database": DB})
        post(srv, "/api/v1/queries", {"name": "one", "connection_name": "pg", "publish": True,
                                      "sql": "SELECT id, v FROM t WHERE id = :id", "parameters": {"id": "int"}})
        keys = [post(srv, "/api/v1/api-keys", {"name": f"k{i}", "queries": ["one"]})["secret"]
                for i in range(OTHERS + 1)]
        wait_watcher(srv)
        conn = http.client.HTTPConnection("127.0.0.1", int(srv.base.rsplit(":", 1)[1]), timeout=30)

        def call(key, rid):
            conn.request("GET", "/q/one?id=1", headers={"X-API-Key": key, "X-Request-Id": rid})
            r = conn.getresponse()
            assert r.status == 200 and r.read() == b'[{"id":1,"v":"a"}]', r.status
        for i in range(3):
            call(keys[0], f"warm-{i}")
        assert served_by(srv, {"warm-2"})["warm-2"] == "plane"  # published by its first call
        for i, key in enumerate(keys[1:]):  # the others' entries push key 0's out of its sets
            call(key, f"other-{i}")
        evicted = [f"evicted-{i}" for i in range(3)]
        for rid in evicted:
            call(keys[0], rid)
        assert set(served_by(srv, set(evicted)).values()) == {"worker:0"}, "key 0's entries were not evicted"
        metrics = requests.get(srv.base + "/metrics", timeout=30).text  # an operator sees the cache too small
        series = 'qag_segment_cache_dropped_total{cause="evicted"}'
        dropped = [ln for ln in metrics.splitlines() if ln.startswith(series)]
        assert dropped and float(dropped[0].split()[-1]) > 0, dropped
        time.sleep(1.5)  # REPUBLISH_CHECK_S: the next warm call looks and puts them back
        call(keys[0], "republish")
        back = [f"back-{i}" for i in range(3)]
        for rid in back:
            call(keys[0], rid)
        got = served_by(srv, set(back))
        assert set(got.values()) == {"plane"}, got
    finally:
        srv.stop()


def test_a_key_granted_many_queries_is_served_by_the_plane():
    """A key's entry carries its row (grants and all) for Python; a key granted many queries by name had a row past
    the 4 KiB slot, the entry was refused, and the plane forwarded every call of that key to Python (found by the
    keys block: at 1,000 distinct queries the plane served none). The entry is published without the row then."""
    need_plane()
    dsn = pg_fresh_db(DB + "_many")
    pg_exec(dsn, "CREATE TABLE t (id int PRIMARY KEY, v text)")
    pg_exec(dsn, "INSERT INTO t VALUES (1, 'a')")
    srv = start_server({}, args=("--workers", "1", "--plane", "--plane-threads", "1"))
    try:
        post(srv, "/api/v1/connections", {"name": "pg", "db": "postgres", "host": "127.0.0.1", "port": 5432,
                                          "user": "postgres", "database": DB + "_many"})
        names = ["one"] + [f"a_saved_query_with_a_rather_long_name_{i:04d}" for i in range(150)]
        for name in names:
            post(srv, "/api/v1/queries", {"name": name, "connection_name": "pg", "publish": True,
                                          "sql": "SELECT id, v FROM t WHERE id = :id", "parameters": {"id": "int"}})
        key = post(srv, "/api/v1/api-keys", {"name": "many", "queries": names, "connections": ["pg"]})["secret"]
        wait_watcher(srv)  # 152 changes: an entry published while generations still move is stale at once
        conn = http.client.HTTPConnection("127.0.0.1", int(srv.base.rsplit(":", 1)[1]), timeout=30)

        def call(rid):
            conn.request("GET", "/q/one?id=1", headers={"X-API-Key": key, "X-Request-Id": rid})
            r = conn.getresponse()
            assert r.status == 200 and r.read() == b'[{"id":1,"v":"a"}]', r.status
        call("many-publish")  # publishes the key's and the plan's entries; the next calls are the plane's
        seen = []
        for attempt in range(5):  # a busy machine's late change can make one round's entries stale: round again
            rids = [f"many-{attempt}-{i}" for i in range(3)]
            for rid in rids:
                call(rid)
            got = served_by(srv, set(rids))
            seen.append([got.get(r) for r in rids])
            if seen[-1] == ["plane"] * 3:
                break
        assert seen[-1] == ["plane"] * 3, seen  # before the fix the plane served none of this key's calls
    finally:
        srv.stop()
