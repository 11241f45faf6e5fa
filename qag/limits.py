"""Rate limits and quotas per key: shared by every host through Redis (`QAG_REDIS_URL`), or per host in the
segment when Redis is not configured or not answering.

- **Rate limits** (`rate_limit: "N/period"`) are token buckets in Redis: capacity N, refilled N per period. A worker
  does not go to Redis for every call: it leases a small block of tokens from the bucket in one atomic script call
  (at most max(1, N // 50) tokens, and never more than the bucket holds) and spends them locally; a lease lives
  at most `LEASE_S` and what is left of it is returned to the bucket. A bucket never grants more than its tokens,
  so the hosts together admit at most the limit; a call waits for no other host.
- **Quotas** (`quota: "N/period"` or QueryAPIGate's `{"calls": N, "rows": M, "per": "day"}`; periods minute, hour,
  day and month, aligned to UTC) are counters in Redis under the period's start, so they are exact across hosts
  and restarts. The counters hold what is *taken*: units spent plus units leased and not yet spent. A worker takes
  a lease of min(`LEASE_CAP`, max(1, left // `LEASE_DIV`)) units from what is left (one atomic script: it never
  grants more than is left, so the hosts together never admit more than N), spends it locally, and gives back
  what it did not spend when the lease ends (`LEASE_S`, the period's end, or the worker's stop), in the same
  script call as its next lease. Far from the limit a quota'd call costs no round trip; within 256 x 2 units of
  it every lease is one unit, taken by the call that spends it: exact per-call counting. A rows quota leases rows
  the same way: a call is admitted while the lease has rows, its rows are spent after it, and rows beyond the
  lease go to Redis at once, so every host sees them before its next lease. A lease given back to a Redis that
  lost the counters (restarted, flushed: the period's epoch token differs) is dropped, never subtracted from
  counters it was not taken from. A worker that dies without stopping strands at most one lease per quota (at
  most `LEASE_CAP` units, never more than 1/256 of what was left): the quota then under-admits by that much.
- **Redis down or slow** (`SOCKET_TIMEOUT_S`): a lease already held is still spent (its units are counted in
  Redis); otherwise the call is decided by the per-host segment windows (never open, never a 5xx), the fallback is
  counted (`qag_limits_fallback_total`) and logged once per outage, and Redis is tried again after `RETRY_S`.

Every limited answer carries `RateLimit-Limit`, `RateLimit-Remaining` and `RateLimit-Reset` (the IETF draft's
names) for the tightest of the key's limits; a quota's Remaining is the counter's (the limit less what every host
has taken, plus what this worker's lease still holds), not the lease's; a 429 carries `Retry-After`.
"""
from __future__ import annotations

import calendar
import logging
import threading
import time
import uuid

from qag.errors import ApiError

log = logging.getLogger("qag.limits")

LEASE_S = 1.0
LEASE_DIV = 256     # a quota lease is at most 1/LEASE_DIV of what is left ...
LEASE_CAP = 1024    # ... and at most this many units
SOCKET_TIMEOUT_S = 0.25   # "slow": a loaded host stalls Redis replies past 50 ms; leases make these waits rare
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
# A quota's lease: give back what the previous one left, then (take = 1) lease a new block.
# KEYS[1] calls taken, KEYS[2] rows taken, KEYS[3] the period's epoch token (made with the counters: a lease
# given back to another epoch's counters is dropped). ARGV: calls limit (0: none), rows limit (0: none), take
# (0/1), the given-back lease's epoch, calls given back (>= 0), rows given back (> 0: unspent; < 0: spent beyond
# the lease, added whatever the epoch), ttl s, a new epoch token, divisor, cap.
# Returns {admitted 0/1, calls leased, rows leased, calls taken, rows taken, epoch}.
_QLEASE = """
local climit = tonumber(ARGV[1]); local rlimit = tonumber(ARGV[2]); local ttl = tonumber(ARGV[7])
local div = tonumber(ARGV[9]); local cap = tonumber(ARGV[10])
local e = redis.call('GET', KEYS[3])
if not e then e = ARGV[8]; redis.call('SET', KEYS[3], e, 'EX', ttl) end
local calls = tonumber(redis.call('GET', KEYS[1]) or '0'); local rows = tonumber(redis.call('GET', KEYS[2]) or '0')
local dc = 0; local dr = 0
local bc = tonumber(ARGV[5]); local br = tonumber(ARGV[6])
if ARGV[4] == e then
  if bc > 0 then dc = -math.min(bc, calls) end
  if br > 0 then dr = -math.min(br, rows) end
end
if br < 0 then dr = -br end
local ok = 0; local gc = 0; local gr = 0
calls = calls + dc; rows = rows + dr
if ARGV[3] == '1' and (climit == 0 or calls < climit) and (rlimit == 0 or rows < rlimit) then
  ok = 1
  if climit > 0 then gc = math.min(cap, math.max(1, math.floor((climit - calls) / div)), climit - calls) end
  if rlimit > 0 then gr = math.min(cap, math.max(1, math.floor((rlimit - rows) / div)), rlimit - rows) end
  dc = dc + gc; dr = dr + gr; calls = calls + gc; rows = rows + gr
end
if dc ~= 0 then redis.call('INCRBY', KEYS[1], dc); redis.call('EXPIRE', KEYS[1], ttl) end
if dr ~= 0 then redis.call('INCRBY', KEYS[2], dr); redis.call('EXPIRE', KEYS[2], ttl) end
return {ok, gc, gr, calls, rows, e}
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


_BOUNDS: dict[str, tuple[float, float]] = {}   # period name -> the current period's (start, end)


def period_bounds(spec: Spec, now: float) -> tuple[float, float]:
    """The UTC-aligned period holding `now`: [start, end). The current one is remembered per period name (a
    calendar month's bounds take two struct_time conversions, ~3.5 us, on every quota'd call otherwise)."""
    b = _BOUNDS.get(spec.per)
    if b is not None and b[0] <= now < b[1]:
        return b
    b = _period_bounds(spec, now)
    _BOUNDS[spec.per] = b
    return b


def _period_bounds(spec: Spec, now: float) -> tuple[float, float]:
    if spec.period is not None:
        start = now - (now % spec.period)
        return start, start + spec.period
    t = time.gmtime(now)
    start = calendar.timegm((t.tm_year, t.tm_mon, 1, 0, 0, 0))
    y, m = (t.tm_year + 1, 1) if t.tm_mon == 12 else (t.tm_year, t.tm_mon + 1)
    return start, calendar.timegm((y, m, 1, 0, 0, 0))


class Decision:
    """What a call's limits said: headers for the answer, and the quota leases its rows are spent from."""

    __slots__ = ("headers", "rows_keys")

    def __init__(self):
        self.headers: dict[str, str] | None = None
        self.rows_keys: list[QuotaLease] = []


class QuotaLease:
    """A worker's lease on one quota period's counters: `calls` and `rows` still to spend here (None: no such
    limit), the epoch of the counters it was taken from, and what the counters held when it was taken."""

    __slots__ = ("base", "calls", "climit", "epoch", "expires", "live", "rlimit", "rows", "taken_calls",
                 "taken_rows", "ttl")

    def __init__(self, base, climit, rlimit, ttl):
        self.base, self.climit, self.rlimit, self.ttl = base, climit, rlimit, ttl
        self.calls = self.rows = 0
        self.taken_calls = self.taken_rows = 0
        self.epoch = ""
        self.expires = 0.0
        self.live = True

    def keys(self):
        return [self.base + ":calls", self.base + ":rows", self.base + ":e"]

    def remaining(self):
        """What the counters leave (every host's leases counted as taken), plus what this lease still holds."""
        if self.climit:
            return self.climit, self.climit - self.taken_calls + self.calls
        return self.rlimit, self.rlimit - self.taken_rows + max(0, self.rows)


class Limiter:
    def __init__(self, cfg, fallback, observe_fallback=None):
        """fallback(field, key_name, spec, now) -> (over, remaining, reset_s): the per-host decision."""
        self.url = getattr(cfg, "redis_url", "") or ""
        self.prefix = "qag:"
        self.fallback = fallback
        self.observe_fallback = observe_fallback or (lambda reason: None)
        self._client = None
        self._take = self._give = self._qlease = None
        self._down_until = 0.0
        self._logged_down = False
        self._lock = threading.Lock()
        self._leases: dict[str, list] = {}         # bucket -> [tokens, expires, capacity, left, reset]
        self._quotas: dict[str, QuotaLease] = {}   # a quota period's counters -> this worker's lease
        self._parsed: dict[int, tuple] = {}          # id(grants) -> (grants, rate_limit, quota, specs)
        self._reaper: threading.Thread | None = None
        self._wake = threading.Event()
        self._stopped = False

    # -- Redis ---------------------------------------------------------------------------------------------
    def _redis(self):
        if not self.url or time.monotonic() < self._down_until:
            return None
        if self._client is None:
            # The scripts are bound before the client is published: a thread that sees a client must find them
            # (a CI run saw a second thread call _qlease while the first was still registering).
            import redis
            with self._lock:
                if self._client is None:
                    client = redis.Redis.from_url(self.url, socket_timeout=SOCKET_TIMEOUT_S,
                                                  socket_connect_timeout=SOCKET_TIMEOUT_S * 4,
                                                  health_check_interval=0)
                    self._take = client.register_script(_TAKE)
                    self._give = client.register_script(_GIVE)
                    self._qlease = client.register_script(_QLEASE)
                    self._client = client
        return self._client

    def _down(self, exc: Exception) -> None:
        self._down_until = time.monotonic() + RETRY_S
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
        rate, quota = grants.get("rate_limit"), grants.get("quota")
        if not rate and not quota:
            return None
        specs = self._specs(grants, rate, quota)
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
        d.headers = {"RateLimit-Limit": str(tight[1]), "RateLimit-Remaining": str(max(0, int(tight[0]))),
                     "RateLimit-Reset": str(max(0, int(tight[2] + 0.999)))}
        return d

    def _specs(self, grants: dict, rate, quota) -> list:
        """The key's limits, parsed once per grants object (a cached key row's stays the same object until the key
        changes; the entry holds it, so its id is not reused while cached, and its values are checked)."""
        hit = self._parsed.get(id(grants))
        if hit is not None and hit[0] is grants and hit[1] == rate and hit[2] == quota:
            return hit[3]
        specs = []
        for field, raw in (("rate_limit", rate), ("quota", quota)):
            if raw:
                try:
                    specs.append((field, parse(field, raw)))
                except ValueError:
                    continue  # refused at save; a row written before the grammar grew is not enforced wrongly
        if len(self._parsed) >= 4096:
            self._parsed.clear()
        self._parsed[id(grants)] = (grants, rate, quota, specs)
        return specs

    def _one(self, field, key_name, spec, now, d):
        if spec.kind == "quota" and self.url:
            local = self._quota_local(key_name, spec, now, d)
            if local is not None:
                return local
        r = self._redis()
        if r is not None:
            try:
                out = self._rate(r, key_name, spec, now) if spec.kind == "rate" else \
                    self._quota_take(key_name, spec, now, d)
                self._up()
                return out
            except Exception as exc:
                if not _is_redis_error(exc):
                    raise
                self._down(exc)
        if self.url:
            self.observe_fallback("redis_unavailable")   # every decision made without Redis
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
                self._reap_soon()
        if old is not None and old[0] > 0:
            self._give(keys=[bucket], args=[old[0], cap])
        return got == 0, int(left) + max(0, got - 1), cap, reset

    # -- quotas: leases on the period's counters -------------------------------------------------------------
    def _quota_base(self, key_name, spec, now):
        start, end = period_bounds(spec, now)
        return f"{self.prefix}quota:{key_name}:{spec.per}:{int(start)}", end

    def _quota_local(self, key_name, spec, now, d):
        """Spend one call of this worker's live lease, or None when there is none to spend."""
        base, end = self._quota_base(key_name, spec, now)
        with self._lock:
            q = self._quotas.get(base)
            if q is None or q.expires <= time.monotonic() or (q.climit and q.calls <= 0) or \
                    (q.rlimit and q.rows <= 0):
                return None
            if q.climit:
                q.calls -= 1
            if q.rlimit:
                d.rows_keys.append(q)
            limit, remaining = q.remaining()
        return False, remaining, limit, end - now

    def _quota_take(self, key_name, spec, now, d):
        """One script call: the previous lease of this period given back, a new one taken (the call spends its
        first unit), or the call refused because nothing is left."""
        base, end = self._quota_base(key_name, spec, now)
        climit, rlimit = spec.calls or 0, spec.rows or 0
        q = QuotaLease(base, climit, rlimit, int(end - now) + 60)
        with self._lock:
            old = self._quotas.pop(base, None)
            if old is not None:
                old.live = False
        back_c, back_r, epoch = (max(0, old.calls), max(0, old.rows), old.epoch) if old is not None else (0, 0, "")
        ok, gc, gr, calls, rows, epoch = self._qlease(
            keys=q.keys(), args=[climit, rlimit, 1, epoch, back_c, back_r, q.ttl, uuid.uuid4().hex, LEASE_DIV,
                                 LEASE_CAP])
        q.calls, q.rows, q.taken_calls, q.taken_rows = int(gc), int(gr), int(calls), int(rows)
        q.epoch = epoch.decode() if isinstance(epoch, bytes) else str(epoch)
        if not ok:
            limit = climit or rlimit
            return True, 0, limit, end - now
        if climit:
            q.calls -= 1
        q.expires = time.monotonic() + min(LEASE_S, max(0.0, end - now))
        with self._lock:
            cur = self._quotas.get(base)
            if cur is not None and cur.epoch == q.epoch:   # another thread of this worker leased meanwhile
                cur.calls += q.calls
                cur.rows += q.rows
                cur.taken_calls = max(cur.taken_calls, q.taken_calls)
                cur.taken_rows = max(cur.taken_rows, q.taken_rows)
                q.live = False
                q = cur
            else:
                if cur is not None:
                    cur.live = False
                    self._pending_back(cur)
                self._quotas[base] = q
            self._reap_soon()
            if rlimit:
                d.rows_keys.append(q)
            limit, remaining = q.remaining()
        return False, remaining, limit, end - now

    def count_rows(self, d: Decision | None, rows: int) -> None:
        """After a call: its rows are spent from the lease it was admitted on; rows beyond the lease go to Redis
        at once (so every host counts them before it next leases)."""
        if d is None or not d.rows_keys or rows <= 0:
            return
        for q in d.rows_keys:
            with self._lock:
                if q.live and q.rows >= rows:
                    q.rows -= rows
                    continue
                beyond = rows - max(0, q.rows) if q.live else rows
                if q.live:
                    q.rows = 0
            self._settle(q, 0, -beyond)

    def _settle(self, q: QuotaLease, calls_back: int, rows_back: int) -> None:
        """Give back a lease's unspent units (or add rows spent beyond it) without taking a new one."""
        if calls_back <= 0 and rows_back == 0:
            return
        r = self._redis()
        if r is None:
            return   # unspent units are lost (the quota under-admits); rows beyond a lease are counted here only
        try:
            self._qlease(keys=q.keys(), args=[q.climit, q.rlimit, 0, q.epoch, max(0, calls_back), rows_back, q.ttl,
                                              uuid.uuid4().hex, LEASE_DIV, LEASE_CAP])
        except Exception as exc:
            if not _is_redis_error(exc):
                raise
            self._down(exc)

    def _pending_back(self, q: QuotaLease) -> None:
        """A lease replaced while it still held units: the reaper gives them back (called under the lock)."""
        if q.calls > 0 or q.rows > 0:
            q.expires = 0.0
            self._quotas[q.base + "\x00" + uuid.uuid4().hex] = q

    # -- leases ending ---------------------------------------------------------------------------------------
    def _reap_soon(self) -> None:
        """Make sure the reaper runs (called under the lock when a lease is installed)."""
        if self._reaper is None and not self._stopped:
            self._reaper = threading.Thread(target=self._reap, name="qag-limits-leases", daemon=True)
            self._reaper.start()
        self._wake.set()

    def _reap(self) -> None:
        """Give back expired leases within LEASE_S of their end, whether or not their key calls again."""
        while not self._stopped:
            with self._lock:
                mono = time.monotonic()
                due_q = [(k, q) for k, q in self._quotas.items() if q.expires <= mono]
                for k, q in due_q:
                    del self._quotas[k]
                    q.live = False
                due_r = [(b, lz) for b, lz in self._leases.items() if lz[1] <= mono]
                for b, _ in due_r:
                    del self._leases[b]
                nxt = min([q.expires for q in self._quotas.values()] + [lz[1] for lz in self._leases.values()],
                          default=None)
                self._wake.clear()
            self._give_back([q for _, q in due_q], due_r)
            self._wake.wait(None if nxt is None else max(0.01, nxt - time.monotonic() + 0.01))

    def _give_back(self, quotas, rates) -> None:
        for q in quotas:
            self._settle(q, max(0, q.calls), max(0, q.rows))
        r = self._redis() if rates else None
        if r is None:
            return
        for bucket, (tokens, _, cap, _, _) in rates:
            if tokens > 0:
                try:
                    self._give(keys=[bucket], args=[tokens, cap])
                except Exception as exc:  # noqa: BLE001
                    if not _is_redis_error(exc):
                        raise
                    self._down(exc)
                    return

    def return_leases(self) -> None:
        """Give back what is left of every lease (at the worker's stop): the counters then hold exactly what this
        worker spent."""
        with self._lock:
            self._stopped = True
            leases, self._leases = self._leases, {}
            quotas, self._quotas = self._quotas, {}
            for q in quotas.values():
                q.live = False
        self._wake.set()
        self._give_back(list(quotas.values()), list(leases.items()))


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
