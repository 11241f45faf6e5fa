"""The response cache's second tier across hosts: Redis (QAG_REDIS_URL, unless QAG_RESPONSE_CACHE_REDIS=0).

The first tier is the host's segment (shm/LAYOUT.md [Response cache]), keyed with the host's generations, which
other hosts do not share. This tier's key is made of store-stable identifiers only: the query's name and the
version that runs (versions are immutable), the connection's name and a digest of its row (a change to it, made
on any host, changes its `updated_at`), the masking fingerprint (which also covers the statement's text), and the
call's R5 suffix (format, page, page size, bound arguments), a digest of the hash-masking key; plus two
eviction epochs in Redis, the query's and everyone's, which an administrator's DELETE /api/v1/cache bumps
(qag/http/cache.py), so an eviction empties this tier too. A host that misses its segment and is the key's
filler (R13) asks Redis once (one script call: epochs and value); an answer found there is stored in the segment
with its own expiry and served as a hit; an answer made here goes to both tiers.

Redis away or slow (a socket timeout of 0.1 s): the tier is skipped for RETRY_S, logged once, counted
(qag_response_cache_total{result="redis_unavailable"}); calls are answered as without it, never a 5xx.
"""
from __future__ import annotations

import hashlib
import json
import logging
import time

import msgpack

log = logging.getLogger("qag.cache")

PREFIX = "qag:resp:"
SOCKET_TIMEOUT_S = 0.1
RETRY_S = 2.0
VALUE_VERSION = 1
# KEYS: the query's epoch, everyone's epoch; ARGV: the key without its epochs. Returns {query epoch, all epoch, value}.
_GET = """
local q = redis.call('GET', KEYS[1]) or '0'
local a = redis.call('GET', KEYS[2]) or '0'
return {q, a, redis.call('GET', ARGV[1] .. ':' .. q .. ':' .. a)}
"""


def epoch_keys(query: str) -> tuple[str, str]:
    return PREFIX + "epoch:q:" + query, PREFIX + "epoch:all"


def connection_stamp(crow: dict) -> bytes:
    """A digest of what a connection row says about where the data is (not its password, not whether active)."""
    fields = {k: crow.get(k) for k in ("name", "db", "host", "port", "user", "database", "options", "created_at",
                                       "updated_at")}
    return hashlib.sha256(json.dumps(fields, sort_keys=True, default=str).encode()).digest()


def shared_prefix(plan, crow: dict, fingerprint: bytes, mask_key: bytes | str | None = None) -> str:
    """The store-stable part of a plan's answers' keys in Redis (with a digest of the hash-masking key: hosts that
    were given different QAG_MASK_KEYs never share a hashed answer)."""
    mk = mask_key.encode() if isinstance(mask_key, str) else (mask_key or b"")
    h = hashlib.sha256()
    for part in (b"s1", plan.query.encode(), str(plan.version).encode(), plan.connection.encode(),
                 connection_stamp(crow), fingerprint, hashlib.sha256(b"qag-mask-key\0" + mk).digest()):
        h.update(len(part).to_bytes(4, "little"))
        h.update(part)
    return PREFIX + plan.query + ":" + h.hexdigest()


class RedisTier:
    def __init__(self, url: str, observer=None):
        self.url = url
        self.observer = observer
        self._client = None
        self._get = None
        self._down_until = 0.0
        self._logged_down = False

    def _redis(self):
        if time.monotonic() < self._down_until:
            return None
        if self._client is None:
            import redis
            self._client = redis.Redis.from_url(self.url, socket_timeout=SOCKET_TIMEOUT_S,
                                                socket_connect_timeout=SOCKET_TIMEOUT_S * 4, health_check_interval=0)
            self._get = self._client.register_script(_GET)
        return self._client

    def _down(self, exc: Exception) -> None:
        self._down_until = time.monotonic() + RETRY_S
        if self.observer is not None:
            self.observer.response_cache("redis_unavailable")
        if not self._logged_down:
            self._logged_down = True
            log.warning("Redis at QAG_REDIS_URL does not answer (%s): cached answers are this host's only until it "
                        "does", type(exc).__name__)

    def _up(self) -> None:
        if self._logged_down:
            self._logged_down = False
            log.warning("Redis answers again: cached answers are shared across hosts again")

    def get(self, query: str, key: str, suffix: bytes):
        """(the full Redis key to store under, the value's fields or None); (None, None) when Redis is away."""
        r = self._redis()
        if r is None:
            return None, None
        base = key + ":" + hashlib.sha256(suffix).hexdigest()
        try:
            qe, ae, raw = self._get(keys=list(epoch_keys(query)), args=[base])
        except Exception as exc:  # noqa: BLE001 - redis raises many types; every one means "not now"
            self._down(exc)
            return None, None
        self._up()
        full = base + ":" + (qe.decode() if isinstance(qe, bytes) else str(qe)) + ":" + \
            (ae.decode() if isinstance(ae, bytes) else str(ae))
        if raw is None:
            return full, None
        try:
            v = msgpack.unpackb(raw, raw=False)
            if v[0] != VALUE_VERSION:
                return full, None
            _, rows, has_more, ttl_s, etag, created, expires, body = v[:8]
        except Exception:  # noqa: BLE001 - a value this version cannot read is a miss
            return full, None
        if time.time_ns() >= expires:
            return full, None
        return full, (rows, bool(has_more), ttl_s, etag, created, expires, body)

    def put(self, full: str, rows: int, has_more: bool, ttl_s: int, etag: bytes, created_ns: int,
            body: bytes) -> None:
        r = self._redis()
        if r is None or full is None:
            return
        value = msgpack.packb([VALUE_VERSION, rows, has_more, ttl_s, etag, created_ns,
                               created_ns + ttl_s * 1_000_000_000, body], use_bin_type=True)
        try:
            r.set(full, value, px=max(1, ttl_s * 1000))
        except Exception as exc:  # noqa: BLE001
            self._down(exc)

    def evict(self, query: str | None) -> bool:
        """An administrator's eviction: the query's epoch (or everyone's) +1, so no earlier answer is found."""
        r = self._redis()
        if r is None:
            return False
        try:
            r.incr(epoch_keys(query or "")[1] if query is None else epoch_keys(query)[0])
        except Exception as exc:  # noqa: BLE001
            self._down(exc)
            return False
        return True
