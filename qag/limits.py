"""Rate limits and quotas per key: shared by every host through Redis (`QAG_REDIS_URL`), or per host in the
segment when Redis is not configured or not answering.

- **Rate limits** (`rate_limit: "N/period"`) are token buckets in Redis: capacity N, refilled N per period. A worker
  does not go to Redis for every call: it leases a small block of tokens from the bucket in one atomic script call
  (at most max(1, N // 50) tokens, and never more than the bucket holds) and spends them locally; a lease lives
  at most `LEASE_S` and what is left of it is returned to the bucket. A bucket never grants more than its tokens,
  so the hosts together admit at most the limit; a call waits for no other host.
- **Quotas** (`quota: "N/period"` or QueryAPIGate's `{"calls": N, "rows": M, "per": "day"}`; periods minute, hour,
  day and month, aligned to UTC) are counters in Redis under the period's start, so they are exact across hosts
  and restarts: each call is one atomic increment-if-below (a quota is a promise about a total, so it is never
  leased); rows are added after the call and a key already over its rows is refused before the next one runs.
- **Redis down or slow** (`SOCKET_TIMEOUT_S`): the call is decided by the per-host segment windows instead (never
  open, never a 5xx), the fallback is counted (`qag_limits_fallback_total`) and logged once per outage, and Redis is
  tried again after `RETRY_S`.

Every limited answer carries `RateLimit-Limit`, `RateLimit-Remaining` and `RateLimit-Reset` (the IETF draft's
names) for the tightest of the key's limits; a 429 carries `Retry-After`.
"""
from __future__ import annotations

import calendar
import logging
import threading
import time

from qag.errors import ApiError

log = logging.getLogger("qag.limits")

LEASE_S = 1.0
SOCKET_TIMEOUT_S = 0.05
RETRY_S = 2.0
PERIODS = {"second": 1, "minute": 60, "hour": 3600, "day": 86400, "month": None}

# KEYS[1] bucket; ARGV capacity, refill per ms, now ms, wanted. Returns {granted, tokens left, ms to full}.
_TAKE = """
local cap = tonumber(ARGV[1]); local rate = tonumber(ARGV[2]); local now = tonumber(ARGV[3])
local want = tonumber(ARGV[4])
local b = redis.call('HMGET', KEYS[1], 't', 'at')
local t = tonumber(b[1]); local at = tonumber(b[2])
if t == nil then t = cap; at = now end
if now > at then t = math.min(cap, t + (now - at) * rate); at = now end
local got = math.min(want, math.floor(t))
t = t - got
redis.call('HSET', KEYS[1], 't', t, 'at', at)
redis.call('PEXPIRE', KEYS[1], math.ceil(cap / rate) + 1000)
return {got, math.floor(t), math.ceil((cap - t) / rate)}
"""
# KEYS[1] bucket; ARGV tokens, capacity: unused leased tokens go back (never above capacity).
_GIVE = """
local t = tonumber(redis.call('HGET', KEYS[1], 't'))
if t ~= nil then redis.call('HSET', KEYS[1], 't', math.min(tonumber(ARGV[2]), t + tonumber(ARGV[1]))) end
return 1
"""
# KEYS[1] calls counter, KEYS[2] rows counter; ARGV calls limit (0: none), rows limit (0: none), ttl s.
# Returns {admitted 0/1, calls used, rows used}.
_QUOTA = """
local calls = tonumber(redis.call('GET', KEYS[1]) or '0'); local rows = tonumber(redis.call('GET', KEYS[2]) or '0')
local climit = tonumber(ARGV[1]); local rlimit = tonumber(ARGV[2])
if (climit > 0 and calls >= climit) or (rlimit > 0 and rows >= rlimit) then return {0, calls, rows} end
calls = redis.call('INCR', KEYS[1]); redis.call('EXPIRE', KEYS[1], tonumber(ARGV[3]))
return {1, calls, rows}
"""


class Spec:
    """One parsed limit: kind 'rate' or 'quota', counts, period in seconds (None: a calendar month)."""

    __slots__ = ("calls", "kind", "per", "period", "rows", "text")

    def __init__(self, kind, calls, rows, per, text):
        self.kind, self.calls, self.rows, self.per, self.text = kind, calls, rows, per, text
        self.period = PERIODS[per]


MAX_COUNT = 10 ** 12  # calls or rows per period: far beyond any use, well inside Redis's and SQLite's integers


def parse(field: str, value) -> Spec:
    """'N/period' for either field; for quota also {"calls": N, "rows": M, "per": period}. ValueError says why."""
    kind = "rate" if field == "rate_limit" else "quota"
    if isinstance(value, str):
        count, sep, per = value.partition("/")
        per = per.strip().lower()
        per = per[:-1] if per.endswith("s") and per[:-1] in PERIODS else per
        count = count.strip()
        if not sep or not (count.isascii() and count.isdigit()) or not 1 <= int(count) <= MAX_COUNT or \
                per not in PERIODS or \
                (kind == "rate" and per == "month"):
            raise ValueError(f"{field} must look like '60/minute' (a positive count, then "
                             f"{'second, minute, hour or day' if kind == 'rate' else 'minute, hour, day or month'})")
        return Spec(kind, int(count), None, per, value)
    if kind == "quota" and isinstance(value, dict):
        unknown = set(value) - {"calls", "rows", "per"}
        calls, rows, per = value.get("calls"), value.get("rows"), str(value.get("per", "day")).lower()
        ok = not unknown and per in PERIODS and per != "second" and (calls is not None or rows is not None)
        for v in (calls, rows):
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= MAX_COUNT):
                ok = False
        if not ok:
            raise ValueError('quota must be "N/period" or {"calls": N, "rows": M, "per": "minute|hour|day|month"} '
                             "with positive whole numbers")
        return Spec(kind, calls, rows, per, value)
    raise ValueError(f"{field} must be a text like '60/minute'" + (" or {\"calls\": N, \"per\": \"day\"}"
                                                                     if kind == "quota" else ""))


def period_bounds(spec: Spec, now: float) -> tuple[float, float]:
    if spec.period is not None:
        start = now - (now % spec.period)
        return start, start + spec.period
    t = time.gmtime(now)
    start = calendar.timegm((t.tm_year, t.tm_mon, 1, 0, 0, 0))
    y, m = (t.tm_year + 1, 1) if t.tm_mon == 12 else (t.tm_year, t.tm_mon + 1)
    return start, calendar.timegm((y, m, 1, 0, 0, 0))


class Decision:
    """What a call's limits said: headers for the answer, and the quota keys to add rows to afterwards."""

    __slots__ = ("headers", "rows_keys")

    def __init__(self):
        self.headers: dict[str, str] | None = None
        self.rows_keys: list[tuple[str, int]] = []


class Limiter:
    def __init__(self, cfg, fallback, observe_fallback=None):
        """fallback(field, key_name, spec, now) -> (over, remaining, reset_s): the per-host decision."""
        self.url = getattr(cfg, "redis_url", "") or ""
        self.prefix = "qag:"
        self.fallback = fallback
        self.observe_fallback = observe_fallback or (lambda reason: None)
        self._client = None
        self._take = self._give = self._quota = None
        self._down_until = 0.0
        self._logged_down = False
        self._lock = threading.Lock()
        self._leases: dict[str, list] = {}   # bucket -> [tokens, expires, capacity]

    # -- Redis ---------------------------------------------------------------------------------------------
    def _redis(self):
        if not self.url or time.monotonic() < self._down_until:
            return None
        if self._client is None:
            import redis
            self._client = redis.Redis.from_url(self.url, socket_timeout=SOCKET_TIMEOUT_S,
                                                socket_connect_timeout=SOCKET_TIMEOUT_S * 4,
                                                health_check_interval=0)
            self._take = self._client.register_script(_TAKE)
            self._give = self._client.register_script(_GIVE)
            self._quota = self._client.register_script(_QUOTA)
        return self._client

    def _down(self, exc: Exception) -> None:
        self._down_until = time.monotonic() + RETRY_S
        self.observe_fallback("redis_unavailable")
        if not self._logged_down:
            self._logged_down = True
            log.warning("Redis at QAG_REDIS_URL does not answer (%s): limits and quotas fall back to this host's "
                        "counters until it does", type(exc).__name__)

    def _up(self) -> None:
        if self._logged_down:
            self._logged_down = False
            log.warning("Redis answers again: limits and quotas are shared across hosts again")

    # -- the call path ---------------------------------------------------------------------------------------
    def check(self, key_name: str, grants: dict) -> Decision | None:
        """Admit the call or raise 429; None when the key has no limit."""
        specs = []
        for field in ("rate_limit", "quota"):
            raw = grants.get(field)
            if raw:
                try:
                    specs.append((field, parse(field, raw)))
                except ValueError:
                    continue  # refused at save; a row written before the grammar grew is not enforced wrongly
        if not specs:
            return None
        now = time.time()
        d = Decision()
        tight = None  # (remaining, limit, reset)
        for field, spec in specs:
            over, remaining, limit, reset = self._one(field, key_name, spec, now, d)
            if over:
                retry = max(1, int(reset + 0.999))
                code, what = ("rate_limited", "may make") if field == "rate_limit" else ("quota_exceeded",
                                                                                          "has a quota of")
                text = spec.text if isinstance(spec.text, str) else _quota_text(spec)
                raise ApiError(429, code, f"This key {what} {text}; wait {retry} s and retry.",
                               {"retry_after": retry},
                               {"Retry-After": str(retry), "RateLimit-Limit": str(limit), "RateLimit-Remaining": "0",
                                "RateLimit-Reset": str(retry)})
            if tight is None or remaining < tight[0]:
                tight = (remaining, limit, reset)
        d.headers = {"RateLimit-Limit": str(tight[1]), "RateLimit-Remaining": str(max(0, tight[0])),
                     "RateLimit-Reset": str(max(0, int(tight[2] + 0.999)))}
        return d

    def _one(self, field, key_name, spec, now, d):
        r = self._redis()
        if r is not None:
            try:
                out = self._rate(r, key_name, spec, now) if spec.kind == "rate" else \
                    self._quota_check(r, key_name, spec, now, d)
                self._up()
                return out
            except Exception as exc:
                if not _is_redis_error(exc):
                    raise
                self._down(exc)
        over, remaining, reset = self.fallback(field, key_name, spec, now)
        limit = spec.calls if spec.calls is not None else spec.rows
        return over, remaining, limit, reset

    def _rate(self, r, key_name, spec, now):
        bucket = f"{self.prefix}rate:{key_name}:{spec.calls}/{spec.per}"
        cap = spec.calls
        refill = cap / (spec.period * 1000.0)
        with self._lock:
            lease = self._leases.get(bucket)
            mono = time.monotonic()
            if lease is not None and lease[0] > 0 and lease[1] > mono:
                lease[0] -= 1
                return False, lease[3], cap, lease[4]
        want = max(1, cap // 50)
        got, left, full_ms = self._take(keys=[bucket], args=[cap, refill, int(now * 1000), want])
        reset = (1.0 / (refill * 1000.0)) if got == 0 else full_ms / 1000.0
        with self._lock:
            old = self._leases.pop(bucket, None)
            if got > 0:
                self._leases[bucket] = [got - 1, time.monotonic() + LEASE_S, cap, int(left) + got - 1, reset]
        if old is not None and old[0] > 0:
            self._give(keys=[bucket], args=[old[0], cap])
        return got == 0, int(left) + max(0, got - 1), cap, reset

    def _quota_check(self, r, key_name, spec, now, d):
        start, end = period_bounds(spec, now)
        base = f"{self.prefix}quota:{key_name}:{spec.per}:{int(start)}"
        ttl = int(end - now) + 60
        admitted, calls, rows = self._quota(keys=[base + ":calls", base + ":rows"],
                                            args=[spec.calls or 0, spec.rows or 0, ttl])
        if spec.rows:
            d.rows_keys.append((base + ":rows", ttl))
        if spec.calls:
            remaining, limit = spec.calls - int(calls), spec.calls
        else:
            remaining, limit = spec.rows - int(rows), spec.rows
        return not admitted, remaining, limit, end - now

    def count_rows(self, d: Decision | None, rows: int) -> None:
        """After a call: its rows count toward the key's rows quota."""
        if d is None or not d.rows_keys or rows <= 0:
            return
        r = self._redis()
        if r is None:
            return
        try:
            pipe = r.pipeline(transaction=False)
            for k, ttl in d.rows_keys:
                pipe.incrby(k, rows)
                pipe.expire(k, ttl)
            pipe.execute()
        except Exception as exc:
            if not _is_redis_error(exc):
                raise
            self._down(exc)

    def return_leases(self) -> None:
        """Give back what is left of every lease (at worker exit, and when leases expire)."""
        r = self._redis()
        with self._lock:
            leases, self._leases = self._leases, {}
        if r is None:
            return
        for bucket, (tokens, _, cap, _, _) in leases.items():
            if tokens > 0:
                try:
                    self._give(keys=[bucket], args=[tokens, cap])
                except Exception:  # noqa: BLE001
                    return


def _quota_text(spec: Spec) -> str:
    parts = []
    if spec.calls:
        parts.append(f"{spec.calls} calls")
    if spec.rows:
        parts.append(f"{spec.rows} rows")
    return " and ".join(parts) + f" per {spec.per}"


def _is_redis_error(exc: Exception) -> bool:
    try:
        import redis
    except ImportError:  # pragma: no cover
        return False
    return isinstance(exc, (redis.RedisError, OSError))
