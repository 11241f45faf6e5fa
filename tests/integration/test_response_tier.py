"""qag/response_tier.py against the machine's Redis (database 14, keys under qag:resp:qag_cache_tier_*): an answer
put by one host's tier is found by another's, expires with its ttl, is gone after an eviction of its query or of
everything (the epochs), and a Redis that does not answer makes the tier step aside quickly, counted, never raising."""
from __future__ import annotations

import socket
import time
import uuid
from types import SimpleNamespace

import pytest

from qag.response_tier import RedisTier, shared_prefix

redis = pytest.importorskip("redis")
URL = "redis://127.0.0.1:6379/14"


class Counts:
    def __init__(self):
        self.seen = []

    def response_cache(self, result):
        self.seen.append(result)


def _plan(query):
    return SimpleNamespace(query=query, version=3, connection="pg")


CROW = {"name": "pg", "db": "postgres", "host": "127.0.0.1", "port": 5432, "user": "u", "database": "d",
        "options": {}, "created_at": "2026-12-02T00:00:00Z", "updated_at": "2026-12-02T00:00:00Z",
        "password_stored": "secret"}


@pytest.fixture()
def query():
    q = "qag_cache_tier_" + uuid.uuid4().hex[:8]
    yield q
    r = redis.Redis.from_url(URL)
    for k in r.scan_iter(f"qag:resp:*{q}*"):
        r.delete(k)


def test_an_answer_put_by_one_host_is_found_by_another(query):
    a, b = RedisTier(URL), RedisTier(URL)
    key = shared_prefix(_plan(query), CROW, b"\x01" * 16)
    full, v = a.get(query, key, b"suffix")
    assert full is not None and v is None
    a.put(full, 2, True, 60, b"e" * 16, time.time_ns(), b"[1, 2]")
    full_b, v = b.get(query, key, b"suffix")
    assert full_b == full and v[0] == 2 and v[1] is True and v[2] == 60 and v[3] == b"e" * 16 and v[6] == b"[1, 2]"
    assert b.get(query, key, b"other suffix")[1] is None


def test_the_key_is_the_version_the_connection_row_and_the_masking(query):
    base = shared_prefix(_plan(query), CROW, b"\x01" * 16)
    assert base != shared_prefix(SimpleNamespace(query=query, version=4, connection="pg"), CROW, b"\x01" * 16)
    assert base != shared_prefix(_plan(query), {**CROW, "updated_at": "2026-12-02T00:00:01Z"}, b"\x01" * 16)
    assert base != shared_prefix(_plan(query), CROW, b"\x02" * 16)
    assert base == shared_prefix(_plan(query), {**CROW, "password_stored": "other"}, b"\x01" * 16)
    assert base != shared_prefix(_plan(query), CROW, b"\x01" * 16, b"another host's QAG_MASK_KEY")


def test_an_eviction_empties_the_tier(query):
    t = RedisTier(URL)
    key = shared_prefix(_plan(query), CROW, b"\x01" * 16)
    full, _ = t.get(query, key, b"s")
    t.put(full, 1, False, 60, b"e" * 16, time.time_ns(), b"x")
    assert t.get(query, key, b"s")[1] is not None
    assert t.evict(query)
    full2, v = t.get(query, key, b"s")
    assert v is None and full2 != full
    t.put(full2, 1, False, 60, b"e" * 16, time.time_ns(), b"x")
    assert t.evict(None)  # everything
    assert t.get(query, key, b"s")[1] is None


def test_an_expired_answer_is_not_served(query):
    t = RedisTier(URL)
    key = shared_prefix(_plan(query), CROW, b"\x01" * 16)
    full, _ = t.get(query, key, b"s")
    t.put(full, 1, False, 1, b"e" * 16, time.time_ns() - 2_000_000_000, b"x")  # made 2 s ago, ttl 1 s
    assert t.get(query, key, b"s")[1] is None


def test_a_redis_that_does_not_answer_is_skipped_counted_and_logged_once(query, caplog):
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(1)  # accepts connections, never answers: a hung Redis
    port = s.getsockname()[1]
    counts = Counts()
    t = RedisTier(f"redis://127.0.0.1:{port}/0", counts)
    try:
        t0 = time.monotonic()
        assert t.get(query, "qag:resp:x", b"s") == (None, None)
        assert time.monotonic() - t0 < 1.5
        assert t.get(query, "qag:resp:x", b"s") == (None, None)  # stepped aside: no second wait
        assert counts.seen == ["redis_unavailable"]
        assert sum("does not answer" in r.message for r in caplog.records) == 1
        t.put("qag:resp:x", 1, False, 60, b"e" * 16, time.time_ns(), b"x")  # never raises
    finally:
        s.close()
