"""Two `qag serve` instances (their own QAG_HOME, ports and segments) as one: one PostgreSQL metadata store, one
Redis, one ClickHouse run store (the loopback chDB server over HTTP). A publish or a connection change made on host
A invalidates B's cached answers within the store's notification delay, and so do a mask added to the key, a
grant taken away and the query deleted; an administrator's eviction on A evicts on B; cache hits count toward a
quota across hosts; a revocation on A stops B within that delay (measured over several trials); every run of both
instances, hits included, lands in the one run store with distinct event ids.

Quotas and rate limits under 16 callers over two hosts, and Redis killed mid-burst, are
tests/e2e/test_core_limits.py's; a revocation while B's change watcher is killed, cut off or hung is
tests/e2e/test_ops_revocations.py's. This file does not repeat them."""
from __future__ import annotations

import concurrent.futures
import json
import os
import shutil
import sqlite3
import statistics
import time
import urllib.parse
import urllib.request
import uuid

import pytest
import requests

from tests.conftest import pg_fresh_db, start_server

pytest.importorskip("chdb")

J = {"Content-Type": "application/json"}
ADMIN = {"X-API-Key": "adm-twohost"}
# The store's notification delay: B's change watcher LISTENs on the store and applies each change through
# the segment's generations; test_ops_revocations.py's control case bounds it at 2 s on a loaded machine.
NOTIFY_S = 2.0
REDIS_DB = 13   # a Redis database of this file's own on the machine's Redis (qag/limits.py's keys are "qag:...")


def _sqlite(path: str, n: int) -> str:
    db = sqlite3.connect(path)
    db.executescript(f"CREATE TABLE t (n INTEGER); INSERT INTO t VALUES ({n});")
    db.commit()
    db.close()
    return path


def _post(srv, path, body, method="POST"):
    r = requests.request(method, srv.base + path, headers={**ADMIN, **J}, data=json.dumps(body), timeout=30)
    assert r.status_code in (200, 201), r.text
    return r.json()


@pytest.fixture(scope="module")
def hosts(tmp_path_factory):
    from tests.e2e.test_recorder_journal_outage import LoopbackClickHouse
    tmp = str(tmp_path_factory.mktemp("twohost"))
    ch = LoopbackClickHouse()
    ch.start()
    store = pg_fresh_db("qag_twohost_store")
    import redis
    redis.Redis(db=REDIS_DB).flushdb()
    env = {"QAG_DATABASE_URL": store, "QAG_REDIS_URL": f"redis://127.0.0.1:6379/{REDIS_DB}",
           "QAG_RUN_STORE_URL": ch.url, "QAG_RUN_WRITERS": "2", "QAG_ADMIN_KEY": ADMIN["X-API-Key"]}
    a = b = None
    try:
        a = start_server({**env, "QAG_RUN_WRITER_ID": "0"}, args=("--workers", "1"))
        b = start_server({**env, "QAG_RUN_WRITER_ID": "1"}, args=("--workers", "2"))
        _post(a, "/api/v1/connections", {"name": "d", "db": "sqlite", "database": _sqlite(f"{tmp}/one.db", 1)})
        _post(a, "/api/v1/queries", {"name": "plain", "connection_name": "d", "sql": "SELECT n FROM t",
                                     "publish": True})
        yield {"a": a, "b": b, "tmp": tmp, "ch": ch}
    finally:
        for srv in (a, b):
            if srv is not None:
                srv.stop()
        ch.stop()
        shutil.rmtree(ch.dir, ignore_errors=True)


def _key(h, queries) -> tuple[str, str]:
    """A key made on A, once B serves it (it learns of it through the store's notifications)."""
    name = "k" + uuid.uuid4().hex[:10]
    secret = _post(h["a"], "/api/v1/api-keys", {"name": name, "queries": queries})["secret"]
    deadline = time.monotonic() + 10
    while requests.get(h["b"].base + f"/q/{queries[0]}", headers={"X-API-Key": secret},
                       timeout=10).status_code == 401:
        assert time.monotonic() < deadline, "host B never saw the key"
        time.sleep(0.05)
    return name, secret


def _until(srv, path, secret, done, limit_s):
    """Call srv until done(response); returns (seconds since the call, the response); fails past limit_s."""
    t0 = time.monotonic()
    while True:
        r = requests.get(srv.base + path, headers={"X-API-Key": secret}, timeout=10)
        if done(r):
            return time.monotonic() - t0, r
        assert r.status_code == 200, r.text
        assert time.monotonic() - t0 < limit_s, f"host B still answers {r.text} after {limit_s} s"
        time.sleep(0.005)


def _hit(srv, path, secret):
    """Call until B answers from its cache (a generation bumped by the watcher's catch-up makes one more miss)."""
    for _ in range(20):
        r = requests.get(srv.base + path, headers={"X-API-Key": secret}, timeout=10)
        assert r.status_code == 200, r.text
        if r.headers["X-Cache"] == "hit":
            return r
        time.sleep(0.1)
    raise AssertionError("host B never answered from its cache")


def test_publish_and_connection_change_on_a_invalidate_b_cache(hosts):
    """Measured here (2 cores, load average 10-15, 7 runs): B answers the new version 25-131 ms after A's publish
    returned, and the moved connection's answer 43-92 ms after A's PATCH returned."""
    a, b = hosts["a"], hosts["b"]
    _post(a, "/api/v1/connections", {"name": "moving", "db": "sqlite",
                                     "database": _sqlite(os.path.join(hosts["tmp"], "moving-one.db"), 1)})
    _post(a, "/api/v1/queries", {"name": "cached", "connection_name": "moving", "sql": "SELECT n FROM t",
                                 "cache_ttl": 600, "publish": True})
    _, secret = _key(hosts, ["cached"])
    old = _hit(b, "/q/cached", secret)
    assert old.json() == [{"n": 1}]

    # a new version published on A: B's cached answer of version 1 is no longer served
    _post(a, "/api/v1/queries/cached/versions", {"sql": "SELECT n + 10 AS n FROM t", "publish": True})
    seconds, new = _until(b, "/q/cached", secret, lambda r: r.json() != [{"n": 1}], NOTIFY_S)
    assert new.status_code == 200 and new.json() == [{"n": 11}], new.text
    assert new.headers["X-Cache"] == "miss" and new.headers["ETag"] != old.headers["ETag"]
    again = _hit(b, "/q/cached", secret)
    assert again.json() == [{"n": 11}]
    print(f"publish on A served on B after {seconds * 1000:.0f} ms")

    # the connection moved to another database on A: B's cached answer from the old one is no longer served
    _post(a, "/api/v1/connections/moving", {"database": _sqlite(os.path.join(hosts["tmp"], "moving-two.db"), 2)},
          "PATCH")
    seconds, moved = _until(b, "/q/cached", secret, lambda r: r.json() != [{"n": 11}], NOTIFY_S)
    assert moved.status_code == 200 and moved.json() == [{"n": 12}], moved.text
    assert moved.headers["X-Cache"] == "miss"
    assert _hit(b, "/q/cached", secret).json() == [{"n": 12}]
    print(f"connection change on A served on B after {seconds * 1000:.0f} ms")


def test_grant_changes_and_a_delete_on_a_reach_b_cached_answers(hosts):
    """A cached answer on B is never served past a change on A to what its caller may see: a mask added to the
    key, the query taken out of its grants, the query deleted."""
    a, b = hosts["a"], hosts["b"]
    _post(a, "/api/v1/queries", {"name": "granted", "connection_name": "d", "sql": "SELECT n FROM t",
                                 "cache_ttl": 600, "publish": True})
    name, secret = _key(hosts, ["granted", "plain"])
    assert _hit(b, "/q/granted", secret).json() == [{"n": 1}]

    _post(a, f"/api/v1/api-keys/{name}", {"mask": [{"column": "t.n", "action": "null"}]}, "PATCH")
    _, masked = _until(b, "/q/granted", secret, lambda r: r.json() != [{"n": 1}], NOTIFY_S)
    assert masked.status_code == 200 and masked.json() == [{"n": None}], masked.text
    assert masked.headers["X-Cache"] == "miss"
    assert _hit(b, "/q/granted", secret).json() == [{"n": None}]

    _post(a, f"/api/v1/api-keys/{name}", {"queries": ["plain"]}, "PATCH")
    _, refused = _until(b, "/q/granted", secret, lambda r: r.status_code != 200, NOTIFY_S)
    # a query the key may not run is one it cannot see (API.md: 404, not 403)
    assert refused.status_code == 404 and refused.json()["code"] == "query_not_found", refused.text

    _post(a, f"/api/v1/api-keys/{name}", {"queries": ["granted", "plain"]}, "PATCH")
    _until(b, "/q/granted", secret, lambda r: r.status_code == 200, NOTIFY_S)
    _hit(b, "/q/granted", secret)
    r = requests.delete(a.base + "/api/v1/queries/granted", headers=ADMIN, timeout=30)
    assert r.status_code in (200, 204), r.text
    _, gone = _until(b, "/q/granted", secret, lambda r: r.status_code != 200, NOTIFY_S)
    assert gone.status_code == 404 and gone.json()["code"] == "query_not_found", gone.text


def test_an_answer_made_on_a_is_a_hit_on_b_through_redis(hosts):
    """The response cache's second tier (qag/response_tier.py): B misses its own segment, finds A's answer in Redis
    (keyed by store-stable identifiers, not by either host's generations), stores it and answers a hit; a new
    version published on A is a miss on B."""
    a, b = hosts["a"], hosts["b"]
    _post(a, "/api/v1/queries", {"name": "tiered", "connection_name": "d", "sql": "SELECT n FROM t", "cache_ttl": 600,
                                 "publish": True})
    _, secret = _key(hosts, ["plain", "tiered"])   # B knows the key (through "plain") before "tiered" is called
    time.sleep(NOTIFY_S)  # both hosts' watchers have applied the query's creation (no catch-up bump to come)
    made = requests.get(a.base + "/q/tiered", headers={"X-API-Key": secret}, timeout=10)
    assert made.status_code == 200 and made.headers["X-Cache"] == "miss", made.text
    got = requests.get(b.base + "/q/tiered", headers={"X-API-Key": secret}, timeout=10)
    assert got.status_code == 200 and got.headers["X-Cache"] == "hit", "B did not find A's answer in Redis"
    assert got.headers["ETag"] == made.headers["ETag"] and got.json() == made.json()
    metrics = requests.get(b.base + "/metrics", timeout=10).text
    assert 'qag_response_cache_total{result="redis"}' in metrics
    _post(a, "/api/v1/queries/tiered/versions", {"sql": "SELECT n + 5 AS n FROM t", "publish": True})
    _, new = _until(b, "/q/tiered", secret, lambda r: r.json() != [{"n": 1}], NOTIFY_S)
    assert new.json() == [{"n": 6}] and new.headers["X-Cache"] == "miss"


def test_an_eviction_on_a_evicts_b_cached_answers(hosts):
    """DELETE /api/v1/cache/{query} made on A (the host a load balancer happened to pick) reaches B through the
    audit row's notification: B's change watcher evicts the same query's answers from B's segment, and only them."""
    a, b = hosts["a"], hosts["b"]
    for q in ("evicted", "kept"):
        _post(a, "/api/v1/queries", {"name": q, "connection_name": "d", "sql": "SELECT n FROM t", "cache_ttl": 600,
                                     "publish": True})
    _, secret = _key(hosts, ["evicted", "kept"])
    _hit(b, "/q/evicted", secret)
    _hit(b, "/q/kept", secret)
    r = requests.delete(a.base + "/api/v1/cache/evicted", headers=ADMIN, timeout=30)
    assert r.status_code == 200, r.text
    deadline = time.monotonic() + NOTIFY_S
    while True:
        listed = requests.get(b.base + "/api/v1/cache", headers=ADMIN, timeout=30).json()["items"]
        if not any(e["query"] == "evicted" for e in listed):
            break
        assert time.monotonic() < deadline, "B still holds the evicted query's answers"
        time.sleep(0.05)
    assert any(e["query"] == "kept" for e in listed), "B evicted another query's answers"
    miss = requests.get(b.base + "/q/evicted", headers={"X-API-Key": secret}, timeout=10)
    assert miss.status_code == 200 and miss.headers["X-Cache"] == "miss"
    assert requests.get(b.base + "/q/kept", headers={"X-API-Key": secret}, timeout=10).headers["X-Cache"] == "hit"


def test_cache_hits_count_toward_a_quota_across_hosts(hosts):
    """test_core_limits.py checks a quota of N over two hosts on uncached calls; answers from the cache are calls
    too (issue 17: "hits still recorded as runs and counted toward quotas")."""
    a, b = hosts["a"], hosts["b"]
    _post(a, "/api/v1/queries", {"name": "quoted", "connection_name": "d", "sql": "SELECT n FROM t",
                                 "cache_ttl": 600, "publish": True})
    name = "k" + uuid.uuid4().hex[:10]
    secret = _post(a, "/api/v1/api-keys", {"name": name, "queries": ["quoted"], "quota": "12/day"})["secret"]
    admitted = 0   # the warm-up's calls: until each host answers from its cache
    for srv in (a, b):
        deadline = time.monotonic() + 10
        while True:
            r = requests.get(srv.base + "/q/quoted", headers={"X-API-Key": secret}, timeout=10)
            assert r.status_code in (200, 401), r.text   # 401: B has not seen the key yet (not a call of it)
            admitted += r.status_code == 200
            if r.headers.get("X-Cache") == "hit":
                break
            assert time.monotonic() < deadline, f"{srv.base} never answered from its cache"
            time.sleep(0.05)
    bases = [a.base, b.base]

    def one(i):
        return requests.get(bases[i % 2] + "/q/quoted", headers={"X-API-Key": secret}, timeout=30)
    with concurrent.futures.ThreadPoolExecutor(16) as ex:
        out = list(ex.map(one, range(48)))
    codes = [r.status_code for r in out]
    assert set(codes) <= {200, 429}, codes
    ok = [r for r in out if r.status_code == 200]
    assert len(ok) == 12 - admitted, f"{len(ok)} of 48 calls admitted after {admitted}: the quota is 12"
    assert all(r.headers["X-Cache"] == "hit" for r in ok)
    assert next(r for r in out if r.status_code == 429).json()["code"] == "quota_exceeded"


def test_a_revocation_on_a_stops_b_within_the_notification_delay(hosts):
    """Measured here (2 cores, load average 10-15; 7 trials a run, 7 runs): B refuses a key revoked on A a median
    of 8-59 ms after A's PATCH returned, at most 86 ms (B polled every ~5 ms plus a call's own time).
    test_ops_revocations.py's control case bounds one trial at 2 s; this one bounds every trial there too."""
    a, b = hosts["a"], hosts["b"]
    delays = []
    for _ in range(7):
        name, secret = _key(hosts, ["plain"])
        for _ in range(5):   # cached on B (its key entry in B's segment)
            assert requests.get(b.base + "/q/plain", headers={"X-API-Key": secret}, timeout=10).status_code == 200
        _post(a, f"/api/v1/api-keys/{name}", {"active": False}, "PATCH")
        seconds, _ = _until(b, "/q/plain", secret, lambda r: r.status_code == 401, NOTIFY_S)
        delays.append(seconds)
    ms = sorted(round(s * 1000) for s in delays)
    print(f"revoked on A, refused on B after (ms): {ms}; median {statistics.median(ms)}, max {ms[-1]}")
    assert max(delays) < NOTIFY_S


def _history(srv, query, request_ids, timeout=60):
    """Every run of `query` in the run store (through srv's history), once it holds those of request_ids."""
    deadline = time.monotonic() + timeout
    while True:
        items, cursor = [], None
        while True:
            url = srv.base + f"/api/v1/history?query={query}&limit=1000" + (f"&cursor={cursor}" if cursor else "")
            page = requests.get(url, headers=ADMIN, timeout=30).json()
            items += page["items"]
            cursor = page["next_cursor"]
            if not cursor:
                break
        missing = request_ids - {x["request_id"] for x in items}
        if not missing:
            return items
        assert time.monotonic() < deadline, f"{len(missing)} of {len(request_ids)} runs are not in the run store"
        time.sleep(0.3)


def _clickhouse(url: str, sql: str) -> list[list[str]]:
    with urllib.request.urlopen(url + "/?" + urllib.parse.urlencode({"query": sql + " FORMAT TSV"}), timeout=30) as r:
        return [line.split("\t") for line in r.read().decode().splitlines()]


def test_every_run_of_both_hosts_lands_in_the_one_run_store(hosts):
    """16 callers over both hosts, half of them on a cached query (a hit is a run too): every answered call is
    one run in the one ClickHouse store, read through either host, no event id twice, each host's runs on its
    own progression of ids (QAG_RUN_WRITER_ID 0 on A, 1 on B, QAG_RUN_WRITERS=2: ids = writer mod 2)."""
    a, b = hosts["a"], hosts["b"]
    queries = ("counted", "counted_cached")
    _post(a, "/api/v1/queries", {"name": queries[0], "connection_name": "d", "sql": "SELECT n FROM t",
                                 "publish": True})
    _post(a, "/api/v1/queries", {"name": queries[1], "connection_name": "d", "sql": "SELECT n FROM t",
                                 "cache_ttl": 600, "publish": True})
    _, secret = _key(hosts, list(queries))
    requests.get(b.base + f"/q/{queries[1]}", headers={"X-API-Key": secret}, timeout=10)
    servers = {"a": a, "b": b}

    def caller(c):
        s, out = requests.Session(), []
        for i in range(10):
            host, query = "ab"[(c + i) % 2], queries[c % 2]
            r = s.get(servers[host].base + f"/q/{query}", headers={"X-API-Key": secret}, timeout=30)
            out.append((host, query, r.status_code, r.headers.get("X-Request-Id"), r.headers.get("X-Cache")))
        return out
    with concurrent.futures.ThreadPoolExecutor(16) as ex:
        answers = [x for out in ex.map(caller, range(16)) for x in out]
    assert [x[2] for x in answers] == [200] * 160
    assert sum(x[4] == "hit" for x in answers) >= 40, "the cached query's calls were not answered from the cache"

    for query in queries:
        by_host = {h: {x[3] for x in answers if x[0] == h and x[1] == query} for h in "ab"}
        assert len(by_host["a"]) == len(by_host["b"]) == 40
        answered = by_host["a"] | by_host["b"]
        for via in (a, b):   # the same store, read through either host
            runs = _history(via, query, answered)
            ids = [x["event_id"] for x in runs]
            assert len(set(ids)) == len(ids), "two runs share an event id"
            mine = [x for x in runs if x["request_id"] in answered]
            assert len(mine) == 80, "an answered call was recorded twice"
            writer = {x["request_id"]: int(x["event_id"]) % 2 for x in mine}
            for host, wid in (("a", 0), ("b", 1)):
                assert {writer[rid] for rid in by_host[host]} == {wid}, f"host {host}'s runs carry the other's ids"
        # and in ClickHouse itself: one row per run, no id twice
        (n, distinct), = _clickhouse(hosts["ch"].url, "SELECT count(), uniqExact(event_id) FROM qag_history "
                                                      f"WHERE query = '{query}'")
        assert int(n) == int(distinct) == len(runs)
