"""The payloads Python and the Rust plane exchange through the segment: the key, plan and connection entries
Python publishes in the shared cache, and the run record every server writes into its ring.

Their fields, msgpack types, order and rules are normative in shm/LAYOUT.md [Entries] and [Run record]; each
is declared once below (`KEY_FIELDS`, `PLAN_FIELDS`, `SPEC_FIELDS`, `CONNECTION_FIELDS`, `RUN_FIELDS`), the
writers follow the declarations, and rustplane/src/entries.rs is the twin that reads them. `python -m
shm.vectors` writes one golden vector of each (shm/vectors/*_entry.bin, run_record.bin) that the Python and
the Rust tests decode field by field against their own declaration: a field added on one side only fails both.

Cache keys: `k:<sha256 hex of secret>` (key entry), `p:<key name>\\0<query name>` (plan entry), `c:<connection
name>` (connection entry; the password never enters the segment: it is in `<QAG_HOME>/plane/conn-<name>.secret`,
mode 0600). Every entry carries the generations it was built from (E1): a reader ignores one whose generations
differ from the segment's, so a stale entry costs a rebuild, never a wrong answer. Only the published version of
a query is ever published as a plan entry (E3, P2).
"""
from __future__ import annotations

import hashlib
import os
import tempfile
import time
from typing import NamedTuple

import msgpack

from qag import params as P
from qag import timeutil
from shm import responses

# One Packer per process: packb() builds a new Packer per call (~0.3 us more, measured).
_pack = msgpack.Packer(use_bin_type=True, autoreset=True).pack
_unpackb = msgpack.unpackb

# -- declarations (LAYOUT.md [Entries]: E4 a map's keys are exactly these, written in this order) ---------------
# (name, msgpack type as LAYOUT.md writes it); the tests compare these with LAYOUT.md, the vectors and
# rustplane/src/entries.rs.

KEY_ENTRY = (
    ("name", "str"), ("active", "bool"), ("expires_at_us", "int|nil"), ("allowed_ips", "[str]|nil"),
    ("prev", "bool"), ("prev_until_us", "int|nil"), ("gen", "uint"), ("rate_limit", "any"), ("row", "map"),
)
PLAN_ENTRY = (
    ("query", "str"), ("version", "int"), ("published_version", "int|nil"), ("connection", "str"),
    ("dialect", "str"), ("sql_native", "str"), ("sql_driver", "str"), ("sql_pieces", "[str]|nil"),
    ("arg_names", "[str]"), ("specs", "[spec]"), ("transforms", "[str|nil]|nil"), ("names", "[str|nil]|nil"),
    ("page_mode", "str"), ("is_write", "bool"), ("write_ops", "[str]"), ("tables", "[str]"),
    ("gens", "[uint, uint, uint]"), ("cache_ttl", "int|nil"), ("default_page_size", "int"),
    ("max_page_size", "int"), ("query_timeout", "float"), ("state_free", "bool"), ("response_prefix", "bin|nil"),
    ("server_allows_writes", "bool"), ("key_allows_writes", "bool"), ("allowed_write_ops", "[str]|nil"),
)
SPEC_ENTRY = (
    ("name", "str"), ("type", "str"), ("required", "bool"), ("has_default", "bool"), ("default", "any"),
    ("enum", "[any]|nil"), ("min", "int|float|nil"), ("max", "int|float|nil"), ("min_length", "int|nil"),
    ("max_length", "int|nil"), ("pattern", "str|nil"),
)
CONNECTION_ENTRY = (
    ("db", "str"), ("host", "str"), ("port", "int"), ("user", "str"), ("database", "str"), ("options", "map"),
    ("active", "bool"), ("gen", "uint"), ("connect_timeout", "float|nil"),
)
KEY_FIELDS = tuple(f for f, _ in KEY_ENTRY)
PLAN_FIELDS = tuple(f for f, _ in PLAN_ENTRY)
SPEC_FIELDS = tuple(f for f, _ in SPEC_ENTRY)
CONNECTION_FIELDS = tuple(f for f, _ in CONNECTION_ENTRY)


def key_cache_key(key_hash: str) -> bytes:
    return b"k:" + key_hash.encode()


def plan_cache_key(key_name: str, query: str) -> bytes:
    return b"p:" + key_name.encode() + b"\x00" + query.encode()


def connection_cache_key(name: str) -> bytes:
    return b"c:" + name.encode()


def _us(text: str | None) -> int | None:
    if not text:
        return None
    d = timeutil.parse(text)
    return int(d.timestamp() * 1_000_000)


# The builders list their fields in the declared order (E4: the map's bytes follow it); a test checks it.
def key_entry(row: dict, via_prev: bool, gen: int) -> dict:
    g = row["grants"]
    return {"name": row["name"], "active": bool(row["active"]), "expires_at_us": _us(row["expires_at"]),
            "allowed_ips": g.get("allowed_ips") or None, "prev": via_prev,
            "prev_until_us": _us(row.get("prev_valid_until")), "gen": gen, "rate_limit": g.get("rate_limit"),
            "row": {k: row[k] for k in ("name", "active", "expires_at", "prev_valid_until", "grants")}}


def plan_entry(plan, cfg, sql_text: str, published_version: int | None = None) -> dict:
    return {"query": plan.query, "version": plan.version, "published_version": published_version,
            "connection": plan.connection, "dialect": plan.dialect,
            "sql_native": P.compile_native(sql_text, plan.dialect)[0], "sql_driver": plan.sql,
            "sql_pieces": P.split_at_markers(sql_text, plan.dialect) if plan.dialect == "mysql" else None,
            "arg_names": list(plan.arg_names),
            "specs": [_spec(s) for s in plan.specs],
            "transforms": list(plan.transforms) if plan.transforms is not None else None,
            "names": list(plan.names) if getattr(plan, "names", None) is not None else None,
            "page_mode": plan.page_mode, "is_write": bool(plan.is_write), "write_ops": sorted(plan.write_ops),
            "tables": sorted(plan.tables), "gens": list(plan.gens), "cache_ttl": plan.cache_ttl,
            "default_page_size": cfg.default_page_size, "max_page_size": cfg.max_page_size,
            "query_timeout": cfg.query_timeout,
            # connectors S5: false means the plane resets the session after the call (LAYOUT.md [Plan entry])
            "state_free": bool(getattr(plan, "state_free", False)),
            # LAYOUT.md [Response cache] R5: the plane appends the call's suffix to look its answer up
            "response_prefix": response_prefix(plan) if plan.cache_ttl and not plan.is_write else None,
            # 1.3: the write decisions governance approved the plan with (qag/plan.py `write_grant`): the plane
            # serves a write only when all three say it may, and re-checks write_ops against allowed_write_ops
            **_write_grant(plan)}


def masking_fingerprint(plan) -> bytes:
    """LAYOUT.md [Response cache] R5: 16 bytes equal for callers whose plans shape a body alike (the masking per
    output column, the traced names it resolved, the statement and its paging), different otherwise; so callers
    with identical masking share cached answers and a masked caller never reads an unmasked one."""
    names = getattr(plan, "names", None)
    shape = [list(plan.transforms) if plan.transforms is not None else None,
             list(names) if names is not None else None, plan.sql, plan.page_mode]
    return hashlib.sha256(_pack(shape)).digest()[:16]


def response_prefix(plan) -> bytes:
    """R5's prefix of a plan's cached answers: query, version, connection, the query's and the connection's
    generations it was built from, the masking fingerprint."""
    return responses.prefix(plan.query, plan.version, plan.connection, plan.gens[1], plan.gens[2],
                            masking_fingerprint(plan))


def _write_grant(plan) -> dict:
    """The plan's write decisions as the entry's 1.3 fields; a plan without them (built without governance)
    says no to all, so the plane forwards its writes (fail closed)."""
    server, key, ops = getattr(plan, "write_grant", None) or (False, False, None)
    return {"server_allows_writes": bool(server), "key_allows_writes": bool(key),
            "allowed_write_ops": sorted(str(o).lower() for o in ops) if ops is not None else None}


def _spec(s) -> dict:
    return {"name": s.name, "type": s.type, "required": bool(s.required), "has_default": bool(s.has_default),
            "default": s.default, "enum": s.enum, "min": s.min, "max": s.max, "min_length": s.min_length,
            "max_length": s.max_length, "pattern": s.pattern}


def connection_entry(row: dict, gen: int, connect_timeout: float | None = None) -> dict:
    """What the plane needs to open the sessions Python's connector opens (PostgreSQL and MySQL/MariaDB:
    qag/connectors.py); `connect_timeout` is cfg.connect_timeout (the query time limit is in each plan)."""
    # Only the text and integer options that shape a session (schema, search_path, sslmode...) go to the plane:
    # flags and lists (allow_superuser, trusted_functions) are Python's plan-time decisions, and the plane reads a
    # connection entry with any other value as unusable.
    options = {k: v for k, v in (row["options"] or {}).items()
               if isinstance(v, str) or isinstance(v, int) and not isinstance(v, bool)}
    return {"db": row["db"], "host": row["host"], "port": row["port"], "user": row["user"],
            "database": row["database"], "options": options, "active": bool(row["active"]), "gen": gen,
            "connect_timeout": connect_timeout}


class Publisher:
    """Writes entries on a cache miss (never on the hot path of a warm call)."""

    def __init__(self, segment, cfg):
        self.seg = segment
        self.cfg = cfg
        self.secret_dir = os.path.join(cfg.home, "plane")

    def key(self, key_hash: str, row: dict, via_prev: bool, gen: int) -> None:
        ck, entry = key_cache_key(key_hash), key_entry(row, via_prev, gen)
        value = _pack(entry)
        if len(ck) + len(value) > self.seg.cache_room:
            # LAYOUT.md [Key entry] field 9: the row (its grants list every query a key may run: 1,000 names are
            # past a 4 KiB slot) is for Python, which keeps its own; the plane serves the key's calls from its
            # plans without it. Without this the entry was refused and the plane forwarded every call of the key.
            value = _pack({**entry, "row": {}})
        self.seg.cache_put(ck, value)

    def has_key(self, key_hash: str) -> bool:
        return self.seg.cache_get(key_cache_key(key_hash)) is not None

    def has_connection(self, name: str) -> bool:
        return self.seg.cache_get(connection_cache_key(name)) is not None

    def has_plan(self, plan) -> bool:
        return plan.key_name is None or self.seg.cache_get(plan_cache_key(plan.key_name, plan.query)) is not None

    def plan(self, plan, sql_text: str, published_version: int | None) -> None:
        """Publish the plan of a key's call. `published_version`: the query's published version when the plan
        was built; a plan of any other version (a draft, an older one: `?version=N`) is not published (E3)."""
        if plan.key_name is None:
            return  # administrators' calls are always served by Python
        if published_version is None or plan.version != published_version:
            return
        self.seg.cache_put(plan_cache_key(plan.key_name, plan.query),
                           _pack(plan_entry(plan, self.cfg, sql_text, published_version)))

    def connection(self, row: dict, password: str | None, gen: int) -> None:
        os.makedirs(self.secret_dir, mode=0o700, exist_ok=True)
        path = os.path.join(self.secret_dir, f"conn-{row['name']}.secret")
        fd, tmp = tempfile.mkstemp(dir=self.secret_dir)
        try:
            os.fchmod(fd, 0o600)
            os.write(fd, (password or "").encode())
        finally:
            os.close(fd)
        os.replace(tmp, path)
        self.seg.cache_put(connection_cache_key(row["name"]),
                           _pack(connection_entry(row, gen, getattr(self.cfg, "connect_timeout", None))))

    def get(self, cache_key: bytes) -> dict | None:
        raw = self.seg.cache_get(cache_key)
        if raw is None:
            return None
        try:
            return msgpack.unpackb(raw, raw=False)
        except Exception:
            return None


# -- the run record (LAYOUT.md [Run record]) ------------------------------------------------------------------
# RR1: a msgpack array of RunRecord's fields in this order. This class is the one declaration: the writers below,
# the worker (qag/server/worker.py), the SQL and ClickHouse run stores' columns (qag/runstore/) derive from it,
# and the plane's encoder (rustplane/src/entries.rs) is checked against the golden vector run_record.bin.

RUN_VERSION = 1


class RunRecord(NamedTuple):
    """One served call as its ring holds it (LAYOUT.md [Run record] RR1: the fields in this order)."""

    v: int                # RR3: the format's major version, 1
    at_us: int            # call start, epoch microseconds UTC
    key_name: str | None
    query: str | None
    version: int | None
    connection: str | None
    status: int           # HTTP status sent
    code: str | None      # error code of the JSON error body, None on success
    rows: int
    duration_us: int
    bytes: int            # response body bytes
    request_id: str
    served_by: str        # "worker:N" or "plane"
    transport: str        # "http", "stream", ...
    route: str            # route template, e.g. "/q/{name}"
    error: str | None     # RR5 (format 1.1): what the database said of a failed call, for administrators only


RUN_FIELDS: tuple[str, ...] = RunRecord._fields
RUN_NFIELDS = len(RUN_FIELDS)
# Each field's Python type as declared ("int", "str | None"...); LAYOUT.md writes "str | None" as str|nil.
RUN_TYPES: tuple[str, ...] = tuple(getattr(a, "__forward_arg__", a) for a in RunRecord.__annotations__.values())
# RR2: the fields of format 1.0 (before `error`); a reader takes such a record (a journal written before an upgrade)
# with the later fields nil.
RUN_NFIELDS_1_0 = RUN_FIELDS.index("error")
_RUN_PAD = (None,) * (RUN_NFIELDS - RUN_NFIELDS_1_0)
# RR5: `error` holds at most this many characters, never a NUL (the run stores refuse one in a string).
RUN_ERROR_MAX = 500


def run_error(db_text: str | None, args=()) -> str | None:
    """The `error` field (RR5) of a call that failed with `db_text`, the database's first line (the connection's
    password already replaced by the connector, connectors S7): each bound parameter's value replaced by
    `[value]` (a value of 3 characters or fewer only where quoted, so that "line 1" stays readable), NULs dropped,
    at most RUN_ERROR_MAX characters. None when the database said nothing."""
    if not db_text:
        return None
    text = db_text.replace("\x00", "")
    for a in sorted({str(a) for a in args or () if a is not None and not isinstance(a, bool)}, key=len, reverse=True):
        if not a:
            continue
        if len(a) > 3:
            text = text.replace(a, "[value]")
        else:
            for q in ('"', "'"):
                text = text.replace(f"{q}{a}{q}", f"{q}[value]{q}")
    return text[:RUN_ERROR_MAX]


def pack_run(at_us, key_name, query, version, connection, status, code, rows, duration_us,
             nbytes, request_id, served_by, transport, route, error=None) -> bytes:
    """Positional encoder for the hot path (no keyword dict built per call); its parameters are RUN_FIELDS[1:]
    (`nbytes` for `bytes`; a test checks the signature against the declaration)."""
    return _pack((RUN_VERSION, at_us, key_name, query, version, connection, status, code, rows,
                  duration_us, nbytes, request_id, served_by, transport, route, error))


def pack_run_of(run: dict, served_by: str) -> bytes:
    """The record of a server's run dict, keyed by RUN_FIELDS (its `served_by` aside), in one call."""
    return _pack((RUN_VERSION, run["at_us"], run["key_name"], run["query"], run["version"], run["connection"],
                  run["status"], run["code"], run["rows"], run["duration_us"], run["bytes"], run["request_id"],
                  served_by, run["transport"], run["route"], run.get("error")))


_RUN_DEFAULTS = {"at_us": None, "key_name": None, "query": None, "version": None, "connection": None,
                 "status": 200, "code": None, "rows": 0, "duration_us": 0, "bytes": 0, "request_id": "",
                 "served_by": "worker:0", "transport": "http", "route": "", "error": None}
if tuple(_RUN_DEFAULTS) != RUN_FIELDS[1:]:
    raise AssertionError("entries._RUN_DEFAULTS must name every RunRecord field after v, in order")


def encode_run(*, v=RUN_VERSION, **fields) -> bytes:
    """Encode one run record by field name (RUN_FIELDS); `at_us` defaults to now."""
    unknown = fields.keys() - _RUN_DEFAULTS.keys()
    if unknown:
        raise TypeError(f"unknown run record fields: {', '.join(sorted(unknown))}")
    values = {**_RUN_DEFAULTS, **fields}
    if values["at_us"] is None:
        values["at_us"] = time.time_ns() // 1000
    return _pack((v, *values.values()))


class RecordError(ValueError):
    """A payload that is not a version-1 run record."""


def decode_run(payload: bytes) -> RunRecord:
    try:
        t = _unpackb(payload, use_list=False, raw=False)
    except Exception as e:  # msgpack raises several unrelated types
        raise RecordError(f"run record is not msgpack: {e}") from None
    if type(t) is not tuple or len(t) < RUN_NFIELDS_1_0 or t[0] != RUN_VERSION:
        raise RecordError(f"run record is not a version-1 array of at least {RUN_NFIELDS_1_0} fields")
    if len(t) != RUN_NFIELDS:  # RR2: fields appended by a later minor version, or a 1.0 record without `error`
        t = t[:RUN_NFIELDS] if len(t) > RUN_NFIELDS else t + _RUN_PAD[:RUN_NFIELDS - len(t)]
    return RunRecord._make(t)
