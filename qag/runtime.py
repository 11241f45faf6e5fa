"""A worker's runtime: settings, the store, generations, and the caches validated against them.

Every cached object remembers the generations it was built from; a lookup compares them with the
current ones (one 8-byte read each when the generations live in the shared segment) and rebuilds on
any difference, so a warm call reads nothing from the metadata store and a change is seen at once.
Each cache is a dict of named entries (`Cached*` below); the key caches are read by qag/auth.py, which
decides who a call is, and the others by `plan()`, which decides what it runs.
"""
from __future__ import annotations

import secrets
import threading
import time
from dataclasses import dataclass
from typing import Any, ClassVar

from qag import connectors
from qag import plan as plan_mod
from qag.errors import ApiError
from qag.store import Store


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


# A warm key or plan looks at most this often that the segment still holds its entry (evicted: put back).
REPUBLISH_CHECK_S = 1.0


@dataclass(slots=True)
class CachedKey:
    """An API key found by its secret's hash: valid while the key's generation is `gen`; `via_prev`: the secret is
    the key's previous one, in a rotation's grace period."""
    name: str
    gen: int
    row: dict
    via_prev: bool
    check_at: float = 0.0  # when to look again that the segment still holds its key entry (qag/auth.py)
    admin: ClassVar[bool] = False


@dataclass(slots=True)
class CachedAdminToken:
    """A named administrator token found by its hash: valid while the global generation is `gen` (tokens have no
    generation slot of their own)."""
    name: str
    gen: int
    admin: ClassVar[bool] = True


class UnknownSecrets:
    """Secrets that matched no key, each with the global generation it was looked up at. A client sending a new
    wrong secret every call must not grow a worker's memory (issue 13: +15 MB after 60,000), so this cache is
    bounded and evicts its oldest entry (insertion order) when full."""

    __slots__ = ("_gens", "_lock", "limit")

    def __init__(self, limit: int = 1024):
        self.limit = limit
        self._gens: dict[str, int] = {}
        self._lock = threading.Lock()

    def get(self, secret_hash: str) -> int | None:
        return self._gens.get(secret_hash)

    def remember(self, secret_hash: str, gen: int) -> None:
        with self._lock:
            known = self._gens
            known.pop(secret_hash, None)
            while len(known) >= self.limit:
                del known[next(iter(known))]
            known[secret_hash] = gen

    def __len__(self) -> int:
        return len(self._gens)


@dataclass(slots=True)
class CachedRole:
    """A role (qag/identity.py) or None when there is none by that name, read at the role's generation `gen`."""
    gen: int
    row: dict | None


@dataclass(slots=True)
class CachedQuery:
    """A saved query's row at the query's generation `gen`, and the versions read at that generation."""
    gen: int
    row: dict | None
    versions: dict[int, dict]


@dataclass(slots=True)
class CachedConnection:
    """A connection's row at the connection's generation `gen`, and its connector (the pool) or None."""
    gen: int
    row: dict | None
    connector: Any
    check_at: float = 0.0  # when to look again that the segment still holds its connection entry


@dataclass(slots=True)
class CachedColumns:
    """A connection's tables and their columns ({(schema, table): columns}), as given and lower-cased."""
    gen: int
    columns: dict
    lowered: dict
    generated: dict | None = None   # {(schema, table) lowercased: {column: sources | None}}, read on first use


@dataclass(slots=True)
class CachedFunctions:
    """A connection's user-defined functions, as (schema, name)."""
    gen: int
    functions: frozenset


@dataclass(slots=True)
class CachedViews:
    """A connection's views and their definitions ({(schema, name): text}), and when they were read (monotonic)."""
    gen: int
    views: dict
    read_at: float
    ancestors: dict | None = None    # {(schema, table) lowercased: ancestors lowercased}, read on first use
    secured: frozenset | None = None  # "schema.table" lowercased of tables with row-level security, on first use


@dataclass(slots=True)
class CachedPrivileges:
    """What the role a connection logs in as may do (connectors S8: `privileged` and its `detail`)."""
    gen: int
    privileges: dict


class Runtime:
    def __init__(self, cfg, store: Store, generations=None, *, slot: int = 0):
        self.cfg = cfg
        self.store = store
        # LocalGenerations, the segment (shm.Segment) or qag.server.changes.WatchedGenerations over it.
        # None: no shared generations, so nothing is cached (always correct).
        self.generations = generations
        self.slot = slot
        # The caches, each entry validated against the generation it was read at (qag/auth.py reads the first two).
        self.keys: dict[str, CachedKey | CachedAdminToken] = {}  # secret hash -> what it was found to be
        self.unknown_secrets = UnknownSecrets()
        self.roles: dict[str, CachedRole] = {}               # role name ->
        self.queries: dict[str, CachedQuery] = {}            # query name ->
        self.connections: dict[str, CachedConnection] = {}   # connection name ->
        self.columns: dict[str, CachedColumns] = {}          # connection name ->
        self.functions: dict[str, CachedFunctions] = {}      # connection name ->
        self.views: dict[str, CachedViews] = {}              # connection name ->
        self.privileges: dict[str, CachedPrivileges] = {}    # connection name ->
        self.plans: dict[tuple, Any] = {}                    # (key, query, version, connection) -> plan.Plan
        self._mask_key: bytes | None = None
        self.plan_hits = 0
        self.plan_misses = 0
        self.publisher = None  # qag.entries.Publisher when a segment is attached
        self.plan_checks: dict = {}  # plan key -> when to look again that the segment holds its entry
        self._stale_at: dict = {}    # connection name -> when its catalogue was last found stale (catalogue_stale)

    # -- changes -------------------------------------------------------------------------------
    def changed(self, kind: str, ident: str) -> None:
        """Called after a change commits and before it is acknowledged."""
        if self.generations is not None:
            self.generations.bump(kind, ident)

    def catalogue_stale(self, conn_name: str) -> None:
        """A result's columns were not the ones a plan traced (a column added since the catalogue was read): the
        connection's generation moves on (at most every 2 s), so every worker and the plane drop the plans built
        on the old catalogue and read it again for the next call."""
        now = time.monotonic()
        if now - self._stale_at.get(conn_name, -10.0) < 2.0:
            return
        self._stale_at[conn_name] = now
        for cache in (self.views, self.columns, self.functions):
            cache.pop(conn_name, None)
        for k in [k for k, p in self.plans.items() if getattr(p, "connection", None) == conn_name]:
            self.plans.pop(k, None)
        self.changed("connection", conn_name)

    # -- metadata, cached ----------------------------------------------------------------------
    def role(self, name: str) -> tuple[dict | None, int]:
        """A signed-in caller's role (qag/identity.py) and its generation (its callers' plans are key-kind)."""
        from qag import identity
        gens = self.generations
        g = gens.gen("key", identity.ROLE_PREFIX + name) if gens is not None else 0
        cached = self.roles.get(name)
        if cached is not None and cached.gen == g and gens is not None:
            return cached.row, g
        row = identity.get_role(self.store, name)
        if gens is not None:
            if len(self.roles) > 1000:
                self.roles.clear()
            self.roles[name] = CachedRole(g, row)
        return row, g

    def query(self, name: str) -> tuple[dict | None, int]:
        gens = self.generations
        if gens is not None:
            cached = self.queries.get(name)
            g = gens.gen("query", name)
            if cached is not None and cached.gen == g:
                return cached.row, g
        else:
            g = 0
        row = self.store.get_query(name)
        if gens is not None:
            self.queries[name] = CachedQuery(g, row, {})
        return row, g

    def version(self, name: str, version: int, gen: int) -> dict | None:
        cached = self.queries.get(name) if self.generations is not None else None
        if cached is not None and cached.gen == gen:
            v = cached.versions.get(version)
            if v is not None:
                return v
        v = self.store.get_version(name, version)
        if cached is not None and cached.gen == gen and v is not None:
            cached.versions[version] = v
        return v

    def connection(self, name: str) -> tuple[dict | None, Any, int]:
        gens = self.generations
        g = gens.gen("connection", name) if gens is not None else 0
        cached = self.connections.get(name)
        if cached is not None and cached.gen == g and gens is not None:
            if self.publisher is not None and cached.row is not None and time.monotonic() >= cached.check_at:
                # evicted from the segment by others' entries: put back, or the plane forwards every call of it
                cached.check_at = time.monotonic() + REPUBLISH_CHECK_S
                if not self.publisher.has_connection(name):
                    self._publish_connection(cached.row, cached.connector, g)
            return cached.row, cached.connector, g
        row = self.store.get_connection(name)
        connector = None
        if row is not None:
            if cached is not None and cached.row is not None and _same_conn(cached.row, row):
                connector = cached.connector  # keep the pool when nothing about the connection changed
            else:
                connector = connectors.make(row, self.store.connection_password(row), self.cfg)
            if self.publisher is not None and gens is not None:
                self._publish_connection(row, connector, g)
        if cached is not None and cached.connector is not None and cached.connector is not connector:
            cached.connector.close()
        # kept without generations too: the entry holds the pool (rebuilt on every call, then compared)
        self.connections[name] = CachedConnection(g, row, connector)
        return row, connector, g

    def _publish_connection(self, row: dict, connector, g: int) -> None:
        """The connection's entry for the plane; a PostgreSQL connection without a search_path option carries the
        path its sessions are pinned to (connectors.PostgresConnector.pinned_search_path), so that the plane's
        sessions resolve bare names as governance did. When that path cannot be read, nothing is published: the
        plane forwards the connection's calls to Python."""
        pinned = getattr(connector, "pinned_search_path", None)
        if pinned is not None:
            try:
                path = pinned()
            except Exception:  # noqa: BLE001 - unreachable now: Python answers its calls (and says why)
                return
            if path is not None:
                row = {**row, "options": {**(row.get("options") or {}), "search_path": path}}
        self.publisher.connection(row, connector.password, g)

    def columns_of_factory(self, conn_name: str, connector, gen: int):
        """A lazy `columns_of(schema, table)` introspecting the connection once per generation."""
        def columns_of(schema: str, table: str):
            cached = self.columns.get(conn_name)
            if cached is None or cached.gen != gen:
                cat = connector.introspect()
                low = {(s.lower(), t.lower()): c for (s, t), c in cat.items()}
                cached = CachedColumns(gen, cat, low)
                self.columns[conn_name] = cached
            cols = cached.columns.get((schema, table))
            if cols is None:
                cols = cached.lowered.get((schema.lower(), table.lower()))
            return list(cols) if cols is not None else None

        def exact(schema: str, table: str):
            """The columns of exactly that relation (PostgreSQL quoted names keep their case), or None."""
            columns_of(schema, table)
            cols = self.columns[conn_name].columns.get((schema, table))
            return list(cols) if cols is not None else None
        def generated(schema: str, table: str):
            """{column: the columns it is computed from, or None (any)} of that table's generated, ALIAS and
            MATERIALIZED columns (lowercased), read once per generation when a masking rule may apply."""
            columns_of(schema, table)
            cached = self.columns[conn_name]
            if cached.generated is None:
                read = getattr(connector, "generated_columns", None)
                got = read() if read is not None else {}
                cached.generated = {
                    (s.lower(), t.lower()): {c.lower(): (tuple(x.lower() for x in deps) if deps is not None else None)
                                             for c, deps in cols.items()}
                    for (s, t), cols in got.items()}
            return cached.generated.get((schema.lower(), table.lower()))
        columns_of.exact = exact
        columns_of.generated = generated
        return columns_of

    def functions_of_factory(self, conn_name: str, connector, gen: int):
        """A lazy `functions_of()`: the connection's user-defined functions, read once per generation and
        only when a plan for a key with an allow-list or masking rules needs them."""
        def functions_of():
            cached = self.functions.get(conn_name)
            if cached is None or cached.gen != gen:
                cached = CachedFunctions(gen, frozenset(connector.user_functions()))
                self.functions[conn_name] = cached
            return cached.functions
        return functions_of

    def views_of_factory(self, conn_name: str, connector, gen: int):
        """A lazy `views_of()`: the connection's views and their definitions ({(schema, name): text}), read once
        per generation and only when a plan for a key with an allow-list or masking rules reads a relation."""
        def views_of():
            cached = self.views.get(conn_name)
            if cached is None or cached.gen != gen:
                read = getattr(connector, "views", None)
                cached = CachedViews(gen, dict(read()) if read is not None else {}, time.monotonic())
                self.views[conn_name] = cached
            return cached.views

        def refresh() -> bool:
            """A statement names a relation the catalogue does not know: read the columns, views and functions
            again (at most every 2 s per connection), in case it was created since they were read."""
            cached = self.views.get(conn_name)
            if cached is not None and cached.gen == gen and time.monotonic() - cached.read_at < 2.0:
                return False
            for cache in (self.views, self.columns, self.functions):
                cache.pop(conn_name, None)
            return True
        def ancestors_of() -> dict:
            """{(schema, table): ((schema, table), ...)} (lowercased): the tables whose rows a partition or an
            INHERITS child also holds, read once per generation with the views, when a key with masking rules
            reads a relation."""
            views_of()
            cached = self.views[conn_name]
            if cached.ancestors is None:
                read = getattr(connector, "ancestors", None)
                got = read() if read is not None else {}
                cached.ancestors = {(s.lower(), t.lower()): tuple((a.lower(), b.lower()) for a, b in anc)
                                    for (s, t), anc in got.items()}
            return cached.ancestors
        def secured_of() -> frozenset:
            """{"schema.table"} (lowercased) of the tables with row-level security, read once per generation with
            the views, when a plan reads a relation (connectors S5: such a read is never proven state-free)."""
            views_of()
            cached = self.views[conn_name]
            if cached.secured is None:
                read = getattr(connector, "row_secured", None)
                got = read() if read is not None else set()
                cached.secured = frozenset(f"{s}.{t}".lower() for s, t in got)
            return cached.secured
        views_of.refresh = refresh
        views_of.ancestors = ancestors_of
        views_of.secured = secured_of
        return views_of

    def plan(self, principal, query_name: str, version_no: int | None, connection_name: str | None = None):
        """The plan for this caller (a qag.auth.Principal) and query, from cache when every generation still
        matches. connection_name runs the query on another connection of the same kind that the caller is
        granted (its own governance)."""
        qrow, qgen = self.query(query_name)
        if qrow is None or not principal.admin and not granted(principal.key, qrow):
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
        plan_gens = (kgen, qgen, cgen)
        if self.generations is not None:
            cached = self.plans.get(pkey)
            if cached is not None and cached.gens == plan_gens:
                self.plan_hits += 1
                if self.publisher is not None and version_no == published and not override:
                    now = time.monotonic()
                    if now >= self.plan_checks.get(pkey, 0.0):
                        self._republish_plan(pkey, cached, query_name, version_no, qgen, published, now)
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
                           cfg=self.cfg, gens=plan_gens,
                           columns_of=self.columns_of_factory(crow["name"], connector, cgen),
                           functions_of=self.functions_of_factory(crow["name"], connector, cgen),
                           views_of=self.views_of_factory(crow["name"], connector, cgen))
        # A governed plan naming relations the catalogue does not know is used once, never kept nor published:
        # kept, it would read a view created later as an ungoverned table.
        if self.generations is not None and not getattr(p, "unknown", ()):
            if len(self.plans) > 10000:
                self.plans.clear()
                self.plan_checks.clear()
            self.plans[pkey] = p
            # The plane looks plans up by (key, query) alone and serves what it finds: only the published
            # version's plan may go there, or a later call without `version` could run another one.
            # A plan binding a claim is never the plane's: it would take the value from the query string.
            if self.publisher is not None and version_no == published and not override and not p.claims:
                self.publisher.plan(p, plan_mod.strip_sql(vrow["sql"]), published)
        return p, crow, connector

    def _republish_plan(self, pkey, plan, query_name: str, version_no: int, qgen: int, published: int,
                        now: float) -> None:
        """A plan published once can be evicted from the segment's cache by others (FIFO per set) while this
        worker still holds it: the plane then forwards its calls here for ever, since a warm plan is never
        published again. So, at most once a REPUBLISH_CHECK_S per plan, a warm call looks (one lock-free read)
        and puts back what is gone."""
        self.plan_checks[pkey] = now + REPUBLISH_CHECK_S
        if plan.claims or self.publisher.has_plan(plan):
            return
        vrow = self.version(query_name, version_no, qgen)
        if vrow is not None:
            self.publisher.plan(plan, plan_mod.strip_sql(vrow["sql"]), published)

    def _override_connection(self, principal, qrow: dict, name: str):
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

    def check_privileged(self, principal, vrow: dict, crow: dict, connector, gen: int) -> None:
        """connectors S8: a key with an allow-list or masking rules may not use a connection whose role is a
        superuser or may read server files, unless its options.allow_superuser is true. The role's privileges
        are read once per connection generation, and only for such keys."""
        if principal.key is None or (crow.get("options") or {}).get("allow_superuser") is True:
            return
        g = principal.key["grants"]
        if not (g.get("allowed_tables") or g.get("mask") or vrow.get("mask")):
            return
        cached = self.privileges.get(crow["name"])
        if cached is None or cached.gen != gen:
            cached = CachedPrivileges(gen, connector.privileges())
            self.privileges[crow["name"]] = cached
        priv = cached.privileges
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
        for name, cached in list(self.connections.items()):
            c = cached.connector
            if c is not None:
                out[name] = (c.in_use, c.idle_count())
        return out

    def close(self) -> None:
        for cached in list(self.connections.values()):
            if cached.connector is not None:
                cached.connector.close()
        self.connections.clear()


def _same_conn(a: dict, b: dict) -> bool:
    fields = ("db", "host", "port", "user", "password_stored", "database", "options", "active")
    return all(a.get(f) == b.get(f) for f in fields)


def granted(key: dict, qrow: dict) -> bool:
    """The key (or a signed-in caller's role) may run this saved query: named, or its connection granted."""
    g = key["grants"]
    qs = g.get("queries") or []
    if qrow["name"] in qs or "*" in qs:
        return True
    cs = g.get("connections") or []
    return qrow["connection_name"] in cs or "*" in cs
