"""Rate limits and quotas shared by two `qag serve` instances (their own QAG_HOME, ports and segments) through one
PostgreSQL metadata store and one Redis: under 16 concurrent callers spread over both, a quota of N calls admits
exactly N, whether it is counted call by call (small N) or leased in blocks (large N: exact once the leases have
come back, within limits.LEASE_S, and with far fewer Redis script calls than calls, from Redis's own INFO
commandstats), and a rate limit at most its bucket; RateLimit-* headers on limited answers, Retry-After on 429;
quotas survive a restart, and a stopped host gives back what it leased and did not spend; Redis killed mid-burst
gives no 5xx, the fallback is counted, and limits are exact again once it is back. The Redis is a private
redis-server on a port of its own (its commandstats are this file's only)."""
from __future__ import annotations

import concurrent.futures
import os
import shutil
import sqlite3
import subprocess
import time
import uuid

import pytest
import requests

from qag import limits
from tests.conftest import free_port, pg_fresh_db

pytestmark = pytest.mark.skipif(shutil.which("redis-server") is None, reason="redis-server is not installed")


def _redis(port: int, tmp: str) -> subprocess.Popen:
    p = subprocess.Popen(["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly",
                          "no", "--dir", tmp], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    import redis
    deadline = time.time() + 10
    while time.time() < deadline:
        try:
            redis.Redis(port=port, socket_timeout=0.2).ping()
            return p
        except redis.RedisError:
            time.sleep(0.05)
    p.kill()
    raise RuntimeError("private redis-server did not start")


@pytest.fixture(scope="module")
def hosts(tmp_path_factory):
    from tests.conftest import start_server
    tmp = str(tmp_path_factory.mktemp("limits"))
    port = free_port()
    rds = _redis(port, tmp)
    h = {"redis": rds}
    a = b = None
    try:   # a set-up that fails (the store at its connection limit) must not leave the private Redis running
        store = pg_fresh_db("qag_core_limits_store")
        data = os.path.join(tmp, "d.db")
        db = sqlite3.connect(data)
        db.executescript("CREATE TABLE t (id INTEGER); INSERT INTO t VALUES (1), (2);")
        db.commit()
        db.close()
        env = {"QAG_DATABASE_URL": store, "QAG_REDIS_URL": f"redis://127.0.0.1:{port}/0",
               "QAG_ADMIN_KEY": "adm-limits"}
        a = start_server(env, args=("--workers", "2"))
        b = start_server(env, args=("--workers", "1"))
        adm = {"X-API-Key": "adm-limits"}
        assert requests.post(a.base + "/api/v1/connections", json={"name": "d", "db": "sqlite", "database": data},
                             headers=adm, timeout=10).status_code == 201
        r = requests.post(a.base + "/api/v1/queries", json={"name": "two", "connection_name": "d", "publish": True,
                                                             "sql": "SELECT id FROM t"}, headers=adm, timeout=10)
        assert r.status_code == 201, r.text
        h.update({"a": a, "b": b, "adm": adm, "redis_port": port, "tmp": tmp, "env": env})
        yield h
    finally:
        for srv in (a, b):
            if srv is not None:
                srv.stop()
        for p in {rds, h["redis"]}:   # the test that kills Redis starts a new one in its place
            p.kill()
            p.wait(5)


def make_key(h, name=None, **grants) -> str:
    name = name or "k" + uuid.uuid4().hex[:10]
    r = requests.post(h["a"].base + "/api/v1/api-keys", json={"name": name, "queries": ["two"], **grants},
                      headers=h["adm"], timeout=10)
    assert r.status_code == 201, r.text
    secret = r.json()["secret"]
    # the other host learns of the key through the store's notifications
    deadline = time.time() + 10
    while requests.get(h["b"].base + "/q/two", headers={"X-API-Key": secret, "X-Request-Id": "warm"},
                       timeout=10).status_code == 401:
        assert time.time() < deadline, "host B never saw the key"
        time.sleep(0.1)
    return secret


def burst(h, secret, n, workers=16):
    bases = [h["a"].base, h["b"].base]

    def one(i):
        return requests.get(bases[i % 2] + "/q/two", headers={"X-API-Key": secret}, timeout=20)
    with concurrent.futures.ThreadPoolExecutor(workers) as ex:
        return list(ex.map(one, range(n)))


def test_a_quota_admits_exactly_n_across_two_hosts(hosts):
    secret = make_key(hosts, quota={"calls": 41, "per": "day"})   # QueryAPIGate's shape; the warm-up call is one
    out = burst(hosts, secret, 120)
    codes = [r.status_code for r in out]
    assert codes.count(200) == 40 and codes.count(429) == 80, codes
    refused = next(r for r in out if r.status_code == 429)
    assert refused.json()["code"] == "quota_exceeded" and int(refused.headers["Retry-After"]) >= 1
    ok = next(r for r in out if r.status_code == 200)
    assert ok.headers["RateLimit-Limit"] == "41" and int(ok.headers["RateLimit-Remaining"]) >= 0
    assert int(ok.headers["RateLimit-Reset"]) > 0


def _scripts(port: int) -> int:
    """Lua scripts Redis ran (a script's first EVALSHA fails with NOSCRIPT and is loaded: not counted)."""
    import redis
    stats = redis.Redis(port=port).info("commandstats")
    return sum(v["calls"] - v.get("failed_calls", 0) - v.get("rejected_calls", 0) for k, v in stats.items()
               if k in ("cmdstat_evalsha", "cmdstat_eval"))


def _taken(h, name: str) -> int:
    """The calls Redis counts as taken from the key's day quota."""
    import redis
    r = redis.Redis(port=h["redis_port"])
    (k,) = list(r.scan_iter(f"qag:quota:{name}:day:*:calls"))
    return int(r.get(k))


def exactly_n_leased(h, n: int, first: int, far: int = 0) -> int:
    """A leased quota of n (first calls already made): `far` calls far from the limit, then a burst past it over
    both hosts, then, once the leases have come back, calls until refused. Returns the Redis scripts run during
    the `far` calls."""
    name = "k" + uuid.uuid4().hex[:10]
    secret = make_key(h, name, quota=f"{n}/day")
    before = _scripts(h["redis_port"])
    out = burst(h, secret, far) if far else []
    scripts = _scripts(h["redis_port"]) - before
    out += burst(h, secret, n - first - far + 400)
    codes = [r.status_code for r in out]
    assert set(codes) <= {200, 429}, codes
    assert codes[:far] == [200] * far
    admitted = first + codes.count(200)
    assert admitted <= n, f"{admitted} admitted: a quota of {n} must never admit more"
    time.sleep(limits.LEASE_S + 1.0)   # every worker's unspent lease goes back within its lifetime
    while True:
        more = [r.status_code for r in burst(h, secret, 16)]
        assert set(more) <= {200, 429}, more
        admitted += more.count(200)
        if more.count(429) == 16:
            break
    assert admitted == n, f"{admitted} admitted once the leases came back: the quota is {n}"
    assert _taken(h, name) == n
    return scripts


def test_a_leased_quota_admits_exactly_n_across_two_hosts_with_few_redis_calls(hosts):
    """A quota of 2,000: its first 1,400 calls leave more than 512, so each worker leases max(1, left // 256) at a
    time (7 down to 2) and they cost a few hundred Redis scripts, not 1,400; the last 512 are counted call by call,
    and exactly 2,000 are admitted."""
    scripts = exactly_n_leased(hosts, 2000, 1, far=1400)
    print(f"{scripts} Redis scripts for 1,400 calls far from the limit of a quota of 2,000")
    assert scripts < 1400 * 0.6, scripts


def test_a_rate_limit_admits_at_most_its_bucket(hosts):
    secret = make_key(hosts, rate_limit="25/minute")
    codes = [r.status_code for r in burst(hosts, secret, 100)]
    assert 0 < codes.count(200) <= 24 and codes.count(200) + codes.count(429) == 100, codes
    unlimited = make_key(hosts)
    r = requests.get(hosts["a"].base + "/q/two", headers={"X-API-Key": unlimited}, timeout=10)
    assert r.status_code == 200 and "RateLimit-Limit" not in r.headers


def test_rows_quota_and_grammar(hosts):
    secret = make_key(hosts, quota={"rows": 5, "per": "hour"})   # the warm-up call read 2 rows
    codes = [requests.get(hosts["a"].base + "/q/two", headers={"X-API-Key": secret}, timeout=10).status_code
             for _ in range(4)]
    assert codes == [200, 200, 429, 429], codes
    for bad in ({"rate_limit": "lots"}, {"rate_limit": "5/month"}, {"quota": {"calls": 0, "per": "day"}},
                {"quota": {"calls": 5, "per": "fortnight"}}, {"quota": {"calls": 5, "colour": 1}}, {"quota": 5}):
        r = requests.post(hosts["a"].base + "/api/v1/api-keys", json={"name": "bad" + uuid.uuid4().hex[:6], **bad},
                          headers=hosts["adm"], timeout=10)
        assert r.status_code == 400 and r.json()["code"] == "invalid_body", (bad, r.text)
        assert r.json().get("field") in ("rate_limit", "quota")


def test_quotas_survive_a_restart(hosts, server_factory):
    secret = make_key(hosts, quota="6/day")
    assert [r.status_code for r in burst(hosts, secret, 4)] == [200] * 4    # 5 used with the warm-up call
    c = server_factory(hosts["env"], args=("--workers", "1"))                # a fresh host, same store and Redis
    codes = [requests.get(c.base + "/q/two", headers={"X-API-Key": secret}, timeout=10).status_code for _ in range(3)]
    assert codes == [200, 429, 429], codes


def test_a_stopping_host_gives_back_its_leases(hosts, server_factory):
    """A host stopped while it holds a lease gives back what it did not spend: Redis then counts exactly the calls
    made, and a host started after it admits the rest."""
    import redis
    name = "k" + uuid.uuid4().hex[:10]
    r = requests.post(hosts["a"].base + "/api/v1/api-keys", json={"name": name, "queries": ["two"],
                                                                  "quota": "100000/day"},
                      headers=hosts["adm"], timeout=10)
    secret = r.json()["secret"]
    c = server_factory(hosts["env"], args=("--workers", "1"))
    rds = redis.Redis(port=hosts["redis_port"])
    made = 0
    for _ in range(5):   # a lease lives LEASE_S: on a slow machine the one read below may come just after its end
        for _ in range(10):
            assert requests.get(c.base + "/q/two", headers={"X-API-Key": secret}, timeout=10).status_code == 200
            made += 1
        (key,) = [k for k in rds.scan_iter(f"qag:quota:{name}:day:*:calls")]
        held = int(rds.get(key)) - made            # what c's worker holds of its lease (of 100000 // 256 = 390)
        if held:
            break
    assert 0 < held < 100000 // limits.LEASE_DIV, held
    c.stop()                                       # SIGTERM: the worker gives back what it did not spend
    assert int(rds.get(key)) == made
    d = server_factory(hosts["env"], args=("--workers", "1"))
    assert requests.get(d.base + "/q/two", headers={"X-API-Key": secret}, timeout=10).status_code == 200
    d.stop()
    assert int(rds.get(key)) == made + 1


def test_redis_down_mid_burst_falls_back_and_comes_back(hosts):
    secret = make_key(hosts, quota="1000/day")
    port = hosts["redis_port"]
    with concurrent.futures.ThreadPoolExecutor(1) as ex:
        fut = ex.submit(burst, hosts, secret, 300, 8)
        time.sleep(0.3)
        hosts["redis"].kill()
        hosts["redis"].wait(5)
        out = fut.result()
    assert all(r.status_code == 200 for r in out), [r.status_code for r in out if r.status_code != 200][:5]
    metrics = requests.get(hosts["a"].base + "/metrics", timeout=10).text
    fallback = sum(float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
                   if line.startswith("qag_limits_fallback_total{"))
    assert fallback > 0, "decisions made without Redis must be counted"
    hosts["redis"] = _redis(port, hosts["tmp"])   # an empty Redis: the day's count starts again there
    # past every worker's retry interval (limits.RETRY_S after its last failed attempt, which on a loaded
    # machine can end well after the burst): then each host decides in Redis again
    time.sleep(2 * limits.RETRY_S + 1.5)
    small = make_key(hosts, quota="11/day")
    codes = [r.status_code for r in burst(hosts, small, 30)]
    assert codes.count(200) == 10, codes
    exactly_n_leased(hosts, 800, 1)   # and leased again, exactly
