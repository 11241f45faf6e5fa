"""A worker's runtime: settings, the store, generations, and the caches validated against them.

Every cached object remembers the generations it was built from; a lookup compares them with the
current ones (one 8-byte read each when the generations live in the shared segment) and rebuilds on
any difference, so a warm call reads nothing from the metadata store and a change is seen at once.
"""
from __future__ import annotations

import hmac
import ipaddress
import secrets
import threading
import time
from typing import Any

from qag import connectors, plan as plan_mod, timeutil
from qag.errors import ApiError
from qag.store import Store, hash_secret


class LocalGenerations:
    """Generations for one process (tests, `qag demo --no-serve`); a segment provides the shared ones."""

    def __init__(self):
        self._g: dict[tuple[str, str], int] = {}
        self._global = 0
        self._lock = threading.Lock()

    def gen(self, kind: str, ident: str) -> int:
        return self._g.get((kind, ident), 0)

    def bump(self, kind: str, ident: str) -> int:
        with self._lock:
            v = self._g.get((kind, ident), 0) + 1
            self._g[(kind, ident)] = v
            self._global += 1
            return v

    def global_gen(self) -> int:
        return self._global


class Principal:
    __slots__ = ("admin", "name", "key", "gen", "claims", "caller")

    def __init__(self, admin: bool, name: str, key: dict | None, gen: int = 0):
        self.admin = admin
        self.name = name      # what plans are keyed by: the key's name, or "role:<name>" for a signed-in caller
        self.key = key
        self.gen = gen
        self.claims = None    # a signed-in caller's verified claims
        self.caller = name    # who is recorded and limited: the key, or "jwt:<sub>"


UNAUTHORIZED = "Give a valid, active API key in the X-API-Key header."


class Runtime:
    def __init__(self, cfg, store: Store, gens=None, *, slot: int = 0):
        self.cfg = cfg
        self.store = store
        self.gens = gens  # None: no shared generations, so nothing is cached (always correct)
        self.slot = slot
        self._keys: dict[str, tuple] = {}        # secret hash -> (gen, global?, principal-ish data)
        self._queries: dict[str, tuple] = {}     # name -> (gen, query row, {version: row})
        self._conns: dict[str, tuple] = {}       # name -> (gen, row, connector)
        self._plans: dict[tuple, Any] = {}
        self._schemas: dict[str, tuple] = {}
        self._functions: dict[str, tuple] = {}  # connection -> (generation, its user-defined functions)
        self._views: dict[str, tuple] = {}      # connection -> (generation, {(schema, view): definition})
        self._privileged: dict[str, tuple] = {}  # connection -> (generation, connectors S8 privileges)
        self._admins: dict[str, tuple] = {}
        # Secrets that matched no key, each with the global generation it was looked up at: a client sending
        # a new wrong secret every call must not grow a worker's memory (issue 13: +15 MB after 60,000), so
        # this cache is bounded and evicts its oldest entry (insertion order) when full.
        self._unknown: dict[str, int] = {}
        self._lock = threading.Lock()
        self._mask_key: bytes | None = None
        self._rate: dict[str, list] = {}
        self._roles: dict[str, tuple] = {}
        self.verifier = None  # qag.identity.Verifier, made at the first signed-in call
        from qag.limits import Limiter
        self.limiter = Limiter(cfg, self._host_window)
        self.plan_hits = 0
        self.plan_misses = 0
        self.publisher = None  # qag.publish.Publisher when a segment is attached
        # one SHA-256 per call serves both checks: the break-glass key is compared by its hash
        self._admin_hash = hash_secret(cfg.admin_key) if cfg.admin_key else None

    # -- changes -------------------------------------------------------------------------------
    def changed(self, kind: str, ident: str) -> None:
        """Called after a change commits and before it is acknowledged."""
        if self.gens is not None:
            self.gens.bump(kind, ident)

    # -- authentication ----------------------------------------------------------------------
    def authenticate(self, secret: str | None, client_ip: str | None) -> Principal:
        if not secret:
            raise ApiError(401, "unauthorized", UNAUTHORIZED)
        h = hash_secret(secret)
        if self._admin_hash is not None and hmac.compare_digest(h, self._admin_hash):
            return Principal(True, "admin", None)
        gens = self.gens
        cached = self._keys.get(h)
        if cached is not None and gens is not None:
            name, gen, row, via_prev = cached
            if name is not None and gens.gen("key", name) == gen:
                return self._check_key(row, via_prev, client_ip, gen)
            if name is None and gens.global_gen() == gen:  # an admin token
                return Principal(True, row, None)
        elif gens is not None and self._unknown.get(h) == gens.global_gen():
            raise ApiError(401, "unauthorized", UNAUTHORIZED)
        gen_before = gens.global_gen() if gens is not None else 0
        row, via_prev = self.store.find_key_by_hash(h)
        if row is None:
            admin = self.store.find_admin(h)
            if gens is not None:
                if admin:  # bounded by the number of administrator tokens
                    self._keys[h] = (None, gen_before, admin, False)
                else:
                    self._remember_unknown(h, gen_before)
            if admin:
                return Principal(True, admin, None)
            raise ApiError(401, "unauthorized", UNAUTHORIZED)
        gen = 0
        if gens is not None:
            # The generation must be read before the row it validates: a change commits, then bumps.
            gen = gens.gen("key", row["name"])
            row, via_prev = self.store.find_key_by_hash(h)
            if row is None:
                raise ApiError(401, "unauthorized", UNAUTHORIZED)
            self._keys[h] = (row["name"], gen, row, via_prev)
            if self.publisher is not None:
                self.publisher.key(h, row, via_prev, gen)
        return self._check_key(row, via_prev, client_ip, gen)

    UNKNOWN_CACHE = 1024

    def _remember_unknown(self, h: str, gen: int) -> None:
        with self._lock:
            unknown = self._unknown
            unknown.pop(h, None)
            while len(unknown) >= self.UNKNOWN_CACHE:
                del unknown[next(iter(unknown))]
            unknown[h] = gen

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
        ips = row["grants"].get("allowed_ips")
        if ips:
            if not client_ip or not _ip_allowed(client_ip, ips):
                raise ApiError(401, "unauthorized", UNAUTHORIZED)
        return Principal(False, row["name"], row, gen)

    def check_rate(self, principal: Principal):
        """Per-key `rate_limit` and `quota` (qag/limits.py: Redis across hosts, else this host's segment); raises
        429, else returns the limits' Decision (its RateLimit-* headers) or None for a key without limits."""
        if principal.key is None:
            return None
        return self.limiter.check(principal.caller, principal.key["grants"])

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
        role, gen = self.role(role_name) if isinstance(role_name, str) else (None, 0)
        if role is None:
            raise ApiError(401, "unauthorized", identity.UNAUTHORIZED)
        ips = role["grants"].get("allowed_ips")
        if ips and (not client_ip or not _ip_allowed(client_ip, ips)):
            raise ApiError(401, "unauthorized", identity.UNAUTHORIZED)
        key = {"name": identity.ROLE_PREFIX + role["name"], "grants": role["grants"], "active": True,
               "expires_at": None, "role": role}
        p = Principal(False, key["name"], key, gen)
        p.claims = claims
        p.caller = "jwt:" + str(claims.get("sub", "?"))[:200]
        return p

    def role(self, name: str) -> tuple[dict | None, int]:
        from qag import identity
        g = self.gens.gen("key", identity.ROLE_PREFIX + name) if self.gens is not None else 0
        cached = self._roles.get(name)
        if cached is not None and cached[0] == g and self.gens is not None:
            return cached[1], g
        row = identity.get_role(self.store, name)
        if self.gens is not None:
            if len(self._roles) > 1000:
                self._roles.clear()
            self._roles[name] = (g, row)
        return row, g

    def _host_window(self, field: str, key_name: str, spec, now: float):
        """The per-host decision (no Redis, or Redis not answering): a fixed window aligned to the period, counted
        across the host's workers in the segment. Returns (over, remaining, seconds to reset)."""
        from qag.limits import period_bounds
        start, end = period_bounds(spec, now)
        count = spec.calls if spec.calls is not None else None
        if count is None:
            return False, spec.rows, end - now   # a rows-only quota is counted in Redis only
        if self.gens is not None and hasattr(self.gens, "gauge_cells"):
            over, used = self._shared_window(field, key_name, start, count)
        else:
            with self._lock:
                k = (field, key_name)
                window = self._rate.get(k)
                if window is None or window[0] != start:
                    window = [start, 0]
                    self._rate[k] = window
                if window[1] >= count:
                    over, used = True, window[1]
                else:
                    window[1] += 1
                    over, used = False, window[1]
        return over, count - used, end - now

    def _shared_window(self, field: str, key_name: str, start: float, count: int) -> tuple[bool, int]:
        """A fixed window counted across every worker of the host: each worker writes its own slot's pair of
        gauge cells (window start, calls in it); the budget is the sum over slots in the current window.
        Two workers deciding in the same microsecond may let one call more through, never a whole worker's
        share."""
        seg, slot = self.gens, self.slot
        labels = (("key", key_name), ("limit", field))
        with self._lock:
            starts = seg.gauge_cells("qag_limit_window_start", labels)
            calls = seg.gauge_cells("qag_limit_window_calls", labels)
            used = sum(c for s_, c in zip(starts, calls) if s_ == start)
            if used >= count:
                return True, used
            if starts[slot] != start:
                seg.gauge_set(slot, "qag_limit_window_calls", labels, 1)
                seg.gauge_set(slot, "qag_limit_window_start", labels, start)
            else:
                seg.gauge_set(slot, "qag_limit_window_calls", labels, calls[slot] + 1)
        return False, used + 1

    # -- metadata, cached ----------------------------------------------------------------------
    def query(self, name: str) -> tuple[dict | None, int]:
        gens = self.gens
        if gens is not None:
            cached = self._queries.get(name)
            g = gens.gen("query", name)
            if cached is not None and cached[0] == g:
                return cached[1], g
        else:
            g = 0
        row = self.store.get_query(name)
        if gens is not None:
            self._queries[name] = (g, row, {})
        return row, g

    def version(self, name: str, version: int, gen: int) -> dict | None:
        cached = self._queries.get(name) if self.gens is not None else None
        if cached is not None and cached[0] == gen:
            v = cached[2].get(version)
            if v is not None:
                return v
        v = self.store.get_version(name, version)
        if cached is not None and cached[0] == gen and v is not None:
            cached[2][version] = v
        return v

    def connection(self, name: str) -> tuple[dict | None, Any, int]:
        gens = self.gens
        g = gens.gen("connection", name) if gens is not None else 0
        cached = self._conns.get(name)
        if cached is not None and cached[0] == g and gens is not None:
            return cached[1], cached[2], g
        row = self.store.get_connection(name)
        connector = None
        if row is not None:
            if cached is not None and cached[1] is not None and _same_conn(cached[1], row):
                connector = cached[2]  # keep the pool when nothing about the connection changed
            else:
                connector = connectors.make(row, self.store.connection_password(row), self.cfg)
            if self.publisher is not None and gens is not None:
                self.publisher.connection(row, connector.password, g)
        if cached is not None and cached[2] is not None and cached[2] is not connector:
            cached[2].close()
        self._conns[name] = (g, row, connector)
        return row, connector, g

    def columns_of_factory(self, conn_name: str, connector, gen: int):
        """A lazy `columns_of(schema, table)` introspecting the connection once per generation."""
        def columns_of(schema: str, table: str):
            cached = self._schemas.get(conn_name)
            if cached is None or cached[0] != gen:
                cat = connector.introspect()
                low = {(s.lower(), t.lower()): c for (s, t), c in cat.items()}
                cached = (gen, cat, low)
                self._schemas[conn_name] = cached
            cols = cached[1].get((schema, table))
            if cols is None:
                cols = cached[2].get((schema.lower(), table.lower()))
            return list(cols) if cols is not None else None
        return columns_of

    def functions_of_factory(self, conn_name: str, connector, gen: int):
        """A lazy `functions_of()`: the connection's user-defined functions, read once per generation and
        only when a plan for a key with an allow-list or masking rules needs them."""
        def functions_of():
            cached = self._functions.get(conn_name)
            if cached is None or cached[0] != gen:
                cached = (gen, frozenset(connector.user_functions()))
                self._functions[conn_name] = cached
            return cached[1]
        return functions_of

    def views_of_factory(self, conn_name: str, connector, gen: int):
        """A lazy `views_of()`: the connection's views and their definitions ({(schema, name): text}), read once
        per generation and only when a plan for a key with an allow-list or masking rules reads a relation."""
        def views_of():
            cached = self._views.get(conn_name)
            if cached is None or cached[0] != gen:
                read = getattr(connector, "views", None)
                cached = (gen, dict(read()) if read is not None else {}, time.monotonic())
                self._views[conn_name] = cached
            return cached[1]

        def refresh() -> bool:
            """A statement names a relation the catalogue does not know: read the columns, views and functions
            again (at most every 2 s per connection), in case it was created since they were read."""
            cached = self._views.get(conn_name)
            if cached is not None and cached[0] == gen and time.monotonic() - cached[2] < 2.0:
                return False
            for cache in (self._views, self._schemas, self._functions):
                cache.pop(conn_name, None)
            return True
        views_of.refresh = refresh
        return views_of

    def plan(self, principal: Principal, query_name: str, version_no: int | None, connection_name: str | None = None):
        """The plan for this caller and query, from cache when every generation still matches. connection_name
        runs the query on another connection of the same kind that the caller is granted (its own governance)."""
        qrow, qgen = self.query(query_name)
        if qrow is None or not principal.admin and not _granted(principal.key, qrow):
            raise ApiError(404, "query_not_found",
                           f"There is no saved query named '{query_name}' that this key may run.")
        override = connection_name is not None and connection_name != qrow["connection_name"]
        published = qrow["published_version"]
        if version_no is None:
            version_no = published
            if version_no is None:
                raise ApiError(404, "not_published",
                               f"The query '{query_name}' has no published version; publish one first.")
        elif version_no != published and not principal.admin:
            # Drafts and retired versions are an administrator's to try (issue 12, class 8). The same answer
            # whether the version exists or not: no oracle for what is being drafted.
            raise ApiError(404, "version_not_found",
                           f"The query '{query_name}' has no version {version_no} that this key may run; "
                           "call it without version to run the published one.")
        if override:
            crow, connector, cgen = self._override_connection(principal, qrow, connection_name)
        else:
            crow, connector, cgen = self.connection(qrow["connection_name"])
        kgen = principal.gen
        pkey = (principal.name if not principal.admin else "\x00admin", query_name, version_no,
                crow["name"] if override else None)
        gens = (kgen, qgen, cgen)
        if self.gens is not None:
            cached = self._plans.get(pkey)
            if cached is not None and cached.gens == gens:
                self.plan_hits += 1
                return cached, crow, connector
        self.plan_misses += 1
        vrow = self.version(query_name, version_no, qgen)
        if vrow is None:
            raise ApiError(404, "version_not_found", f"The query '{query_name}' has no version {version_no}.")
        if crow is None or connector is None:
            raise ApiError(502, "connection_failed",
                           f"The connection '{qrow['connection_name']}' of this query no longer exists.")
        if not crow["active"]:
            raise ApiError(403, "connection_inactive",
                           f"The connection '{crow['name']}' is inactive; an administrator must reactivate it.")
        self.check_privileged(principal, vrow, crow, connector, cgen)
        p = plan_mod.build(key=principal.key, query=qrow, version=vrow, connection=crow, connector=connector,
                           cfg=self.cfg, gens=gens, columns_of=self.columns_of_factory(crow["name"], connector, cgen),
                           functions_of=self.functions_of_factory(crow["name"], connector, cgen),
                           views_of=self.views_of_factory(crow["name"], connector, cgen))
        # A governed plan naming relations the catalogue does not know is used once, never kept nor published:
        # kept, it would read a view created later as an ungoverned table.
        if self.gens is not None and not getattr(p, "unknown", ()):
            if len(self._plans) > 10000:
                self._plans.clear()
            self._plans[pkey] = p
            # The plane looks plans up by (key, query) alone and serves what it finds: only the published
            # version's plan may go there, or a later call without `version` could run another one.
            # A plan binding a claim is never the plane's: it would take the value from the query string.
            if self.publisher is not None and version_no == published and not override and not p.claims:
                self.publisher.plan(p, plan_mod.strip_sql(vrow["sql"]), published)
        return p, crow, connector

    def _override_connection(self, principal: Principal, qrow: dict, name: str):
        """`connection_name=`: granted to this caller (an administrator may name any), and of the same kind."""
        grants = {} if principal.admin else (principal.key.get("grants") or {})
        granted = principal.admin or name in (grants.get("connections") or []) or "*" in (grants.get("connections")
                                                                                          or [])
        if not granted:
            raise ApiError(403, "connection_forbidden",
                           f"This key is not granted a connection named '{name}'; leave connection_name out to "
                           "use the query's own.")
        crow, connector, cgen = self.connection(name)
        if crow is None or connector is None:
            raise ApiError(404, "connection_not_found", f"There is no connection named '{name}'.")
        own, _, _ = self.connection(qrow["connection_name"])
        if own is not None and own["db"] != crow["db"]:
            raise ApiError(400, "connection_mismatch",
                           f"The query '{qrow['name']}' is written for {own['db']}; the connection '{name}' is "
                           f"{crow['db']}. Name a {own['db']} connection.")
        return crow, connector, cgen

    def check_privileged(self, principal: Principal, vrow: dict, crow: dict, connector, gen: int) -> None:
        """connectors S8: a key with an allow-list or masking rules may not use a connection whose role is a
        superuser or may read server files, unless its options.allow_superuser is true. The role's privileges
        are read once per connection generation, and only for such keys."""
        if principal.key is None or (crow.get("options") or {}).get("allow_superuser") is True:
            return
        g = principal.key["grants"]
        if not (g.get("allowed_tables") or g.get("mask") or vrow.get("mask")):
            return
        cached = self._privileged.get(crow["name"])
        if cached is None or cached[0] != gen:
            cached = (gen, connector.privileges())
            self._privileged[crow["name"]] = cached
        priv = cached[1]
        if priv["privileged"]:
            raise ApiError(403, "connection_privileged",
                           f"The connection '{crow['name']}' logs in as a role that is a superuser or can read server "
                           f"files ({', '.join(priv['detail'])}); a key with an allow-list or masking rules may not "
                           "use it unless an administrator sets the connection's options.allow_superuser to true.")

    @property
    def mask_key(self) -> bytes:
        if self._mask_key is None:
            if self.cfg.mask_key:
                self._mask_key = self.cfg.mask_key.encode("utf-8")
            else:
                self._mask_key = self.store.kv_get_or_set("mask_key", lambda: secrets.token_hex(32)).encode("utf-8")
        return self._mask_key

    def pool_stats(self) -> dict[str, tuple[int, int]]:
        out = {}
        for name, (_, _, c) in list(self._conns.items()):
            if c is not None:
                out[name] = (c.in_use, c.idle_count())
        return out

    def close(self) -> None:
        for _, _, c in list(self._conns.values()):
            if c is not None:
                c.close()
        self._conns.clear()


_UNSET = object()


def _ts(text: str | None) -> float | None:
    return timeutil.parse(text).timestamp() if text else None


def _same_conn(a: dict, b: dict) -> bool:
    fields = ("db", "host", "port", "user", "password_stored", "database", "options", "active")
    return all(a.get(f) == b.get(f) for f in fields)


def _granted(key: dict, qrow: dict) -> bool:
    g = key["grants"]
    qs = g.get("queries") or []
    if qrow["name"] in qs or "*" in qs:
        return True
    cs = g.get("connections") or []
    return qrow["connection_name"] in cs or "*" in cs


def _ip_allowed(ip: str, nets: list[str]) -> bool:
    try:
        addr = ipaddress.ip_address(ip)
    except ValueError:
        return False
    for n in nets:
        try:
            if addr in ipaddress.ip_network(n, strict=False):
                return True
        except ValueError:
            continue
    return False


_PERIODS = {"second": 1, "minute": 60, "hour": 3600, "day": 86400}


def parse_rate(spec: str) -> tuple[int, int]:
    """'60/minute' -> (60, 60); the grammar QueryAPIGate uses for rate_limit."""
    if not isinstance(spec, str) or "/" not in spec:
        raise ValueError("rate_limit must look like '60/minute' (second, minute, hour or day)")
    count, _, period = spec.partition("/")
    period = period.strip().lower().rstrip("s")
    if not count.strip().isdigit() or int(count) < 1 or period not in _PERIODS:
        raise ValueError("rate_limit must look like '60/minute' (second, minute, hour or day)")
    return int(count), _PERIODS[period]
