"""Who is calling, and may they call now: API keys, administrator tokens, signed-in callers, IP allow-lists,
rate limits and quotas — the per-call decision, made on every call before a plan is looked up.

A key's row comes from the runtime's key cache (qag/runtime.py), valid while the key's generation is the one it
was read at (one 8-byte read from the segment), so a revocation takes effect before the call that made it
returns. Active, expiry, a rotated secret's grace and the IP allow-list are checked against the row on every
call. Limits and quotas are counted by qag/limits.py (Redis across hosts); when Redis is not configured or not
answering, this module's per-host windows, counted across the host's workers in the segment, decide.
"""
from __future__ import annotations

import hashlib
import hmac
import ipaddress
import json
import re
import threading
import time

from qag import timeutil
from qag.capacity import caller_cells
from qag.errors import ApiError
from qag.limits import Limiter, period_bounds
from qag.runtime import REPUBLISH_CHECK_S, CachedAdminToken, CachedKey
from qag.store import CALLER_LIMIT_FIELDS, hash_secret

UNAUTHORIZED = "Give a valid, active API key in the X-API-Key header."
ROLE_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,99}")  # qag/http/manage.py NAME_RE, which names roles


class Principal:
    """Who a call is: an administrator, an API key (its row in `key`), or a signed-in caller (a role's grants in
    `key`, the verified claims in `claims`); `gen`: the key's generation, which the call's plan must match."""

    __slots__ = ("admin", "caller", "claims", "gen", "key", "name")

    def __init__(self, admin: bool, name: str, key: dict | None, gen: int = 0):
        self.admin = admin
        self.name = name      # what plans are keyed by: the key's name, or "role:<name>" for a signed-in caller
        self.key = key
        self.gen = gen
        self.claims = None    # a signed-in caller's verified claims
        self.caller = name    # who is recorded and limited: the key, or "jwt:<sub>"


class Auth:
    """One worker's authentication and limits, over its runtime (qag.runtime.Runtime: store, generations and
    the key, secret and role caches)."""

    def __init__(self, runtime):
        self.runtime = runtime
        self.cfg = runtime.cfg
        self.verifier = None  # qag.identity.Verifier, made at the first signed-in call
        self.limiter = Limiter(runtime.cfg, self._host_window)
        self._windows: dict[tuple[str, str], list] = {}  # (field, key) -> [window start, calls]: no segment
        self._lock = threading.Lock()
        # one SHA-256 per call serves both checks: the break-glass key is compared by its hash
        self._admin_hash = hash_secret(runtime.cfg.admin_key) if runtime.cfg.admin_key else None

    # -- API keys and administrator tokens -----------------------------------------------------------------
    def authenticate(self, secret: str | None, client_ip: str | None) -> Principal:
        """The caller of X-API-Key `secret` from `client_ip`, or 401 unauthorized (one sentence for every way in
        that failed). Warm, it reads one generation from the segment and nothing from the store."""
        if not secret:
            raise ApiError(401, "unauthorized", UNAUTHORIZED)
        return self.authenticate_hash(hash_secret(secret), client_ip)

    def authenticate_hash(self, h: str, client_ip: str | None) -> Principal:
        """authenticate() of a secret known by its SHA-256 only: a Console session holds the hash of the
        administrator credential it was opened with and is worth no more than that credential is now (a revoked
        token or a changed QAG_ADMIN_KEY ends its sessions on their next request)."""
        if self._admin_hash is not None and hmac.compare_digest(h, self._admin_hash):
            return Principal(True, "admin", None)
        rt = self.runtime
        gens = rt.generations
        if gens is not None:
            cached = rt.keys.get(h)
            if cached is not None:
                if cached.admin:
                    if gens.global_gen() == cached.gen:
                        return Principal(True, cached.name, None)
                elif gens.gen("key", cached.name) == cached.gen:
                    if rt.publisher is not None and time.monotonic() >= cached.check_at:
                        self._republish_key(h, cached)
                    return self._check_key(cached.row, cached.via_prev, client_ip, cached.gen)
            elif rt.unknown_secrets.get(h) == gens.global_gen():
                raise ApiError(401, "unauthorized", UNAUTHORIZED)
        gen_before = gens.global_gen() if gens is not None else 0
        store = rt.store
        row, via_prev = store.find_key_by_hash(h)
        if row is None:
            admin = store.find_admin(h)
            if gens is not None:
                if admin:  # bounded by the number of administrator tokens
                    rt.keys[h] = CachedAdminToken(admin, gen_before)
                else:
                    rt.unknown_secrets.remember(h, gen_before)
            if admin:
                return Principal(True, admin, None)
            raise ApiError(401, "unauthorized", UNAUTHORIZED)
        gen = 0
        if gens is not None:
            # The generation must be read before the row it validates: a change commits, then bumps.
            gen = gens.gen("key", row["name"])
            row, via_prev = store.find_key_by_hash(h)
            if row is None:
                raise ApiError(401, "unauthorized", UNAUTHORIZED)
            rt.keys[h] = CachedKey(row["name"], gen, row, via_prev)
            if rt.publisher is not None and not python_only(row["grants"]):
                rt.publisher.key(h, row, via_prev, gen)
        return self._check_key(row, via_prev, client_ip, gen)

    def _republish_key(self, h: str, cached) -> None:
        """The key entry a cold call published can be evicted from the segment by others while this worker still
        holds the key: the plane would forward its calls here for ever. At most once a REPUBLISH_CHECK_S, a warm
        call looks (one lock-free read) and puts it back."""
        rt = self.runtime
        cached.check_at = time.monotonic() + REPUBLISH_CHECK_S
        if not python_only(cached.row["grants"]) and not rt.publisher.has_key(h):
            rt.publisher.key(h, cached.row, cached.via_prev, cached.gen)

    def _check_key(self, row: dict, via_prev: bool, client_ip: str | None, gen: int) -> Principal:
        if not row["active"]:
            raise ApiError(401, "unauthorized", UNAUTHORIZED)
        exp = row.get("_expires_ts", _UNSET)
        if exp is _UNSET:  # parsed once per cached row, not per call
            exp = row["_expires_ts"] = _ts(row["expires_at"])
            row["_prev_until_ts"] = _ts(row.get("prev_valid_until"))
        if exp is not None or via_prev:
            now = time.time()
            if exp is not None and exp <= now:
                raise ApiError(401, "unauthorized", UNAUTHORIZED)
            if via_prev:
                until = row["_prev_until_ts"]
                if until is None or until <= now:
                    raise ApiError(401, "unauthorized", UNAUTHORIZED)
        if row["grants"].get("allowed_ips") and (not client_ip or not _allowed_for(row, client_ip)):
            raise ApiError(401, "unauthorized", UNAUTHORIZED)
        return Principal(False, row["name"], row, gen)

    # -- signed-in callers (qag/identity.py) ----------------------------------------------------------------
    def authenticate_caller(self, secret: str | None, authorization: str | None, client_ip: str | None):
        """X-API-Key when given; else a Bearer token whose role claim names a role; else 401."""
        if secret or not authorization:
            return self.authenticate(secret, client_ip)
        from qag import identity
        scheme, _, token = authorization.partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            raise ApiError(401, "unauthorized", identity.UNAUTHORIZED)
        if self.verifier is None:
            self.verifier = identity.Verifier(self.cfg)
        claims = self.verifier.verify(token.strip())
        role_name = claims.get(self.verifier.role_claim)
        # a claim that cannot be a role's name (roles are named as keys are) names none: no store lookup for it
        role, gen = self.runtime.role(role_name) if isinstance(role_name, str) and ROLE_NAME_RE.fullmatch(
            role_name) else (None, 0)
        if role is None:
            raise ApiError(401, "unauthorized", identity.UNAUTHORIZED)
        if role["grants"].get("allowed_ips") and (not client_ip or not _allowed_for(role, client_ip)):
            raise ApiError(401, "unauthorized", identity.UNAUTHORIZED)
        key = {"name": identity.ROLE_PREFIX + role["name"], "grants": role["grants"], "active": True,
               "expires_at": None, "role": role}
        p = Principal(False, key["name"], key, gen)
        p.claims = claims
        p.caller = caller_of(claims.get("sub"))
        return p

    # -- rate limits and quotas (qag/limits.py) ---------------------------------------------------------------
    def check_rate(self, principal: Principal):
        """Per-key `rate_limit` and `quota` (qag/limits.py: Redis across hosts, else this host's segment); raises
        429, else returns the limits' Decision (its RateLimit-* headers) or None for a key without limits."""
        if principal.key is None:
            return None
        return self.limiter.check(principal.caller, principal.key["grants"])

    def _host_window(self, field: str, key_name: str, spec, now: float):
        """The per-host decision (no Redis, or Redis not answering): a fixed window aligned to the period, counted
        across the host's workers in the segment. Returns (over, remaining, seconds to reset)."""
        start, end = period_bounds(spec, now)
        count = spec.calls if spec.calls is not None else None
        if count is None:
            return False, spec.rows, end - now   # a rows-only quota is counted in Redis only
        gens = self.runtime.generations
        shared = None
        if gens is not None and hasattr(gens, "gauge_cells"):
            shared = self._shared_window(gens, field, key_name, start, count)
        if shared is not None:
            over, used = shared
        else:
            with self._lock:
                k = (field, key_name)
                window = self._windows.get(k)
                if window is None or window[0] != start:
                    if window is None and len(self._windows) >= MAX_LOCAL_WINDOWS:
                        # callers have no bound (signed-in subjects): a window of a past period counts nothing
                        for old in [w for w, v in self._windows.items() if v[0] < start]:
                            del self._windows[old]
                    window = [start, 0]
                    self._windows[k] = window
                if window[1] >= count:
                    over, used = True, window[1]
                else:
                    window[1] += 1
                    over, used = False, window[1]
        return over, count - used, end - now

    def _shared_window(self, seg, field: str, key_name: str, start: float, count: int) -> tuple | None:
        """A fixed window counted across every worker of the host: each worker writes its own slot's pair of
        gauge cells (window start, calls in it); the budget is the sum over slots in the current window.
        Two workers deciding in the same microsecond may let one call more through, never a whole worker's
        share."""
        slot = self.runtime.slot
        labels = (("key", key_name), ("limit", field))
        with self._lock:
            # None when the segment has no room left for this caller's series: this worker's window decides
            starts = caller_cells(seg, "qag_limit_window_start", labels)
            calls = caller_cells(seg, "qag_limit_window_calls", labels) if starts is not None else None
            if calls is None:
                return None
            used = sum(c for s_, c in zip(starts, calls) if s_ == start)
            if used >= count:
                return True, used
            if starts[slot] != start:
                seg.gauge_set(slot, "qag_limit_window_calls", labels, 1)
                seg.gauge_set(slot, "qag_limit_window_start", labels, start)
            else:
                seg.gauge_set(slot, "qag_limit_window_calls", labels, calls[slot] + 1)
        return False, used + 1


_UNSET = object()
MAX_LOCAL_WINDOWS = 10000  # this worker's own limit windows (no segment, or no room in it) before past ones go


def caller_of(sub) -> str:
    """Who a signed-in caller is recorded, limited and followed on /events as: `jwt:` and its subject, one name per
    subject. Control characters, quotes and backslashes are escaped as JSON escapes them (a log line cannot be
    split, and two subjects never print alike); a subject past 200 characters keeps 180 and a digest of the whole
    (two long subjects with one prefix stay two callers). A token without a subject is `jwt?`, a name no key can
    have and no subject can give."""
    if sub is None:
        return "jwt?"
    text = json.dumps(str(sub), ensure_ascii=False)[1:-1]
    if len(text) > 200:
        text = text[:180] + "~" + hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()[:16]
    return "jwt:" + text


PYTHON_ONLY_GRANTS = ("quota",) + CALLER_LIMIT_FIELDS


def python_only(grants: dict) -> bool:
    """A key with a quota or a limit of its own (max_rows, query_timeout, max_concurrent) is served by Python only:
    its key entry is not published, so the data plane finds none and forwards its calls (rustplane: "no current
    key entry"), and no limit is left to a process that does not count it. (A rate-limited key's entry is
    published: the plane forwards it by its `rate_limit` field.)"""
    return any(grants.get(f) is not None for f in PYTHON_ONLY_GRANTS)


def _ts(text: str | None) -> float | None:
    return timeutil.parse(text).timestamp() if text else None


def networks(nets: list[str]) -> tuple:
    """An allow-list's networks, parsed; an entry that is not one (refused at save) matches nothing."""
    out = []
    for n in nets:
        try:
            out.append(ipaddress.ip_network(n, strict=False))
        except ValueError:
            continue
    return tuple(out)


def ip_allowed(ip: str, nets: tuple) -> bool:
    """The caller's address is in one of the networks (from networks()). An IPv4 caller seen through an IPv6
    socket (`::ffff:a.b.c.d`, a dual-stack bind) is the IPv4 address it maps, and matches as either; an address
    with a zone (`fe80::1%eth0`) matches as the address."""
    try:
        addr = ipaddress.ip_address(ip.split("%", 1)[0] if "%" in ip else ip)
    except ValueError:
        return False
    mapped = addr.ipv4_mapped if addr.version == 6 else None
    return any(addr in net or (mapped is not None and mapped in net) for net in nets) or (
        addr.version == 4 and any(net.version == 6 and ipaddress.IPv6Address(f"::ffff:{addr}") in net
                                  for net in nets))


def _allowed_for(row: dict, ip: str) -> bool:
    """A key's or a role's allow-list, parsed once per cached row, not per call (8.5 -> 4.0 us a call, two
    networks)."""
    nets = row.get("_ip_networks")
    if nets is None:
        nets = row["_ip_networks"] = networks(row["grants"]["allowed_ips"])
    return ip_allowed(ip, nets)
