"""The Management API (administrators only): connections, saved queries and their versions, API keys.

Every change commits in the store (with its audit row), then bumps the generations it affects,
then answers: so no worker serves a revoked key or an old version once the call has returned.
"""
from __future__ import annotations

import base64
import hashlib
import hmac
import math
import re
import time

import falcon

from qag import params as P
from qag import plan as plan_mod
from qag import timeutil
from qag.errors import ApiError, DomainError, Unreachable
from qag.http import errors as http_errors
from qag.http.common import ok, read_json, require_admin
from qag.store import CALLER_LIMIT_FIELDS, GRANT_FIELDS, public_connection, public_key

NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,99}")
DBS = ("postgres", "mysql", "sqlite", "clickhouse")
WRITE_OPS = ("insert", "update", "delete", "merge", "replace", "upsert", "create", "drop", "alter", "truncate",
             "grant", "revoke", "copy", "call", "lock")
MASK_ACTIONS = ("hash", "mask", "null", "drop")


def check_name(value, what: str, reserved: str | None = None) -> str:
    """A name for a new connection, query, key or role. `reserved`: the one name a route of its collection
    already takes (/api/v1/connections/test, /api/v1/queries/validate), which could be saved but never read,
    changed or deleted at its own address."""
    if not isinstance(value, str) or not NAME_RE.fullmatch(value):
        raise ApiError(400, "invalid_name", f"{what} must be 1-100 characters: letters, digits, '_', '.', '-', "
                       f"starting with a letter or digit.")
    if reserved is not None and value == reserved:
        raise ApiError(400, "invalid_name", f"{what} cannot be '{reserved}': that address is a route of its own; "
                       "pick another name.")
    return value


def check_fields(body: dict, allowed: tuple, required: tuple = ()) -> None:
    unknown = [k for k in body if k not in allowed]
    if unknown:
        raise ApiError(400, "unknown_field", f"Unknown field(s) {', '.join(sorted(unknown))}; allowed: "
                       f"{', '.join(allowed)}.", {"fields": sorted(unknown)})
    missing = [k for k in required if body.get(k) in (None, "")]
    if missing:
        raise ApiError(400, "field_required", f"Missing required field(s): {', '.join(missing)}.",
                       {"fields": missing})


def _type_error(field: str, what: str) -> ApiError:
    return ApiError(400, "invalid_field", f"{field} must be {what}.", {"field": field})


def _opt(body, field, types, what):
    v = body.get(field)
    if v is None:
        return None
    if isinstance(v, bool) and bool not in (types if isinstance(types, tuple) else (types,)):
        raise _type_error(field, what)
    if not isinstance(v, types):
        raise _type_error(field, what)
    return v


def _str_list(body, field):
    v = body.get(field)
    if v is None:
        return None
    if not isinstance(v, list) or not all(isinstance(x, str) and x for x in v):
        raise _type_error(field, "a list of non-empty strings")
    return v


def list_limit(req, what: str, default: int) -> int:
    """A paged list's query string: only limit (1-1000, `default` when absent or empty) and cursor are taken, any
    other name is 400 unknown_field (`what` names the list in that sentence)."""
    unknown = set(req.params) - {"limit", "cursor"}
    if unknown:
        raise ApiError(400, "unknown_field", f"Unknown parameter(s) {', '.join(sorted(unknown))}; {what} takes limit "
                       "and cursor.", {"fields": sorted(unknown)})
    raw = req.params.get("limit")
    if raw is None or raw == "":
        return default
    if not isinstance(raw, str) or not P.INT_RE.fullmatch(raw) or not 1 <= P.text_int(raw) <= 1000:
        raise ApiError(400, "invalid_paging", "limit must be an integer between 1 and 1000.")
    return int(raw)


def list_page(items, req, key, numbered=False, default: int | None = 100):
    """`{"items": [...], "next_cursor": ...}` with ?limit= and an opaque cursor (the last name seen, with a check
    so that a cursor this server did not give is 400 invalid_cursor rather than a silently different page).
    Any other query-string name is 400 unknown_field."""
    limit = list_limit(req, "a list", default if default is not None else max(len(items), 1))
    cursor = req.params.get("cursor")
    if cursor:
        last = read_cursor(cursor)
        if numbered:  # a list ordered by a number (a query's versions)
            if not last.isdigit() or len(last) > 19:
                raise ApiError(400, "invalid_cursor", "cursor is not one this server gave.")
            last = int(last)
        items = [i for i in items if i[key] > last]
    page = items[:limit]
    nxt = make_cursor(str(page[-1][key])) if len(items) > limit else None
    return {"items": page, "next_cursor": nxt}


_CURSOR_CHECK = b"qag list cursor v1"


def make_cursor(last: str) -> str:
    raw = last.encode()
    tag = hashlib.blake2b(raw, digest_size=6, key=_CURSOR_CHECK).digest()
    return base64.urlsafe_b64encode(tag + raw).decode().rstrip("=")


def read_cursor(cursor) -> str:
    """The last name of the previous page, from a cursor make_cursor() gave; 400 invalid_cursor otherwise."""
    bad = ApiError(400, "invalid_cursor", "cursor is not one this server gave; use the next_cursor of the previous "
                   "page, or leave cursor out for the first page.")
    if not isinstance(cursor, str) or len(cursor) > 600:
        raise bad
    try:
        data = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4))
        tag, raw = data[:6], data[6:]
        if len(data) < 7 or not hmac.compare_digest(tag, hashlib.blake2b(raw, digest_size=6,
                                                                         key=_CURSOR_CHECK).digest()):
            raise ValueError
        return raw.decode()
    except (ValueError, UnicodeDecodeError):
        raise bad from None


# -- connections ----------------------------------------------------------------------------------
CONN_FIELDS = ("name", "db", "host", "port", "user", "password", "database", "active", "options")


def validate_connection(body: dict, partial: bool = False, probe: bool = False) -> dict:
    check_fields(body, CONN_FIELDS, () if partial else ("name", "db"))
    out = {}
    if "name" in body and not partial:
        out["name"] = check_name(body["name"], "name", None if probe else "test")  # /test names none it saves
    if "db" in body:
        if body["db"] not in DBS:
            raise ApiError(400, "invalid_field", f"db must be one of {', '.join(DBS)}.", {"field": "db"})
        out["db"] = body["db"]
    for f in ("host", "user", "password", "database"):
        if f in body:
            out[f] = _opt(body, f, str, "a string")
    if "port" in body:
        port = body["port"]
        if port is not None and (isinstance(port, bool) or not isinstance(port, int) or not 0 < port < 65536):
            raise _type_error("port", "an integer between 1 and 65535")
        out["port"] = port
    if "active" in body:
        if not isinstance(body["active"], bool):
            raise _type_error("active", "true or false")
        out["active"] = body["active"]
    if "options" in body:
        if body["options"] is not None and not isinstance(body["options"], dict):
            raise _type_error("options", "an object")
        out["options"] = body["options"] or {}
        _check_trusted_functions(out["options"])
    if not partial and out.get("db") == "sqlite" and not out.get("database"):
        raise ApiError(400, "field_required", "A sqlite connection needs database: the path of its file.",
                       {"fields": ["database"]})
    return out


def _check_trusted_functions(options: dict) -> None:
    """options.trusted_functions (issue 12): functions governed keys may call beyond the dialect's allow-list."""
    from qag.governance.functions import parse_trusted
    try:
        parse_trusted(options.get("trusted_functions"))
    except ValueError as exc:
        raise ApiError(400, "invalid_field", f"{exc}.", {"field": "options.trusted_functions"}) from None


class Connections:
    def __init__(self, app):
        self.app = app

    def on_get(self, req, resp):
        require_admin(self.app, req)
        rows = [public_connection(r) for r in self.app.runtime.store.list_connections()]
        ok(resp, list_page(rows, req, "name"))

    def on_post(self, req, resp):
        p = require_admin(self.app, req)
        c = validate_connection(read_json(req, self.app.cfg))
        c.setdefault("active", True)
        store = self.app.runtime.store
        if c["active"] and store.get_connection(c["name"]) is None:
            # an active connection is reached before it is saved ("active": false saves one on purpose)
            reach(self.app, _probe_row(c), c.get("password"))
        row = store.create_connection(p.name, c)
        self.app.runtime.changed("connection", c["name"])
        ok(resp, public_connection(row), 201)


class Connection:
    def __init__(self, app):
        self.app = app

    def _get(self, name):
        row = self.app.runtime.store.get_connection(name)
        if row is None:
            raise ApiError(404, "connection_not_found", f"There is no connection named '{name}'.")
        return row

    def on_get(self, req, resp, name):
        require_admin(self.app, req)
        ok(resp, public_connection(self._get(name)))

    def on_patch(self, req, resp, name):
        p = require_admin(self.app, req)
        body = read_json(req, self.app.cfg)
        if "name" in body and body["name"] != name:
            raise ApiError(400, "invalid_field", "A connection cannot be renamed; create a new one.",
                           {"field": "name"})
        body.pop("name", None)
        changes = validate_connection(body, partial=True)
        store = self.app.runtime.store
        before = store.get_connection(name)
        if before is not None and changes.get("active", before["active"]) and (
                not before["active"] or set(changes) & REACH_FIELDS):
            # what an active connection becomes is reached before it is saved, as at create
            merged = {**before, **{k: v for k, v in changes.items() if k != "password"}}
            password = changes["password"] if "password" in changes else store.connection_password(before)
            reach(self.app, _probe_row(merged), password)
        row = store.update_connection(p.name, name, changes)
        self.app.runtime.changed("connection", name)
        ok(resp, public_connection(row))

    def on_delete(self, req, resp, name):
        p = require_admin(self.app, req)
        self.app.runtime.store.delete_connection(p.name, name)
        self.app.runtime.changed("connection", name)
        resp.status = falcon.HTTP_204


REACH_FIELDS = {"db", "host", "port", "user", "password", "database", "options"}


def _probe_row(c: dict) -> dict:
    return {"name": c["name"], "db": c["db"], "host": c.get("host"), "port": c.get("port"), "user": c.get("user"),
            "database": c.get("database"), "options": c.get("options") or {}, "active": True}


def reach(app, row: dict, password) -> tuple[float, dict]:
    """Connect and run SELECT 1 as a call would (/connections/test, and before an active connection is saved):
    (latency in s, privileges). Unreachable: 502 connection_failed with the driver's words (administrators only
    call this: they help)."""
    from qag import connectors
    conn = connectors.make(row, password, app.cfg)
    t0 = time.perf_counter()
    try:
        conn.run("SELECT 1", (), write=False, timeout=None, max_rows=1, state_free=True)
        latency = time.perf_counter() - t0
        # connectors S8: keys with an allow-list or masking rules are refused a privileged connection
        # (403 connection_privileged) unless options.allow_superuser is true
        try:
            priv = conn.privileges()
        except connectors.ConnectorError:
            priv = {"superuser": None, "server_files": None, "privileged": None, "detail": []}
    except connectors.QueryFailed as exc:
        raise ApiError(502, "connection_failed", f"Connected, but SELECT 1 failed: {exc.db_text}") from None
    except Unreachable as exc:
        raise http_errors.answer(exc, admin=True) from None  # administrators only here: the driver's words help
    finally:
        conn.close()
    return latency, priv


class ConnectionTest:
    def __init__(self, app):
        self.app = app

    def on_post(self, req, resp):
        require_admin(self.app, req)
        body = read_json(req, self.app.cfg)
        store = self.app.runtime.store
        if set(body) == {"name"}:
            row = store.get_connection(body["name"]) if isinstance(body["name"], str) else None
            if row is None:
                raise ApiError(404, "connection_not_found", f"There is no connection named '{body['name']}'.")
            password = store.connection_password(row)
        else:
            body.setdefault("name", "test")
            c = validate_connection(body, probe=True)
            row = {"name": c["name"], "db": c["db"], "host": c.get("host"), "port": c.get("port"),
                   "user": c.get("user"), "database": c.get("database"), "options": c.get("options") or {},
                   "active": True}
            password = c.get("password")
        latency, priv = reach(self.app, row, password)
        allowed = (row.get("options") or {}).get("allow_superuser") is True
        ok(resp, {"ok": True, "name": row["name"], "db": row["db"], "latency_ms": round(latency * 1000, 3),
                  "privileged": priv["privileged"], "superuser": priv["superuser"],
                  "server_files": priv["server_files"], "privileges": priv["detail"], "allow_superuser": allowed,
                  "governed_keys_allowed": not priv["privileged"] or allowed})


# -- queries --------------------------------------------------------------------------------------
QUERY_FIELDS = ("name", "connection_name", "sql", "parameters", "description", "publish", "cache_ttl", "mask",
                "allow_unsafe")
VERSION_FIELDS = ("sql", "parameters", "description", "publish", "mask", "allow_unsafe", "connection_name",
                  "cache_ttl")


def validate_mask(rules, field="mask"):
    if rules is None:
        return []
    if not isinstance(rules, list):
        raise _type_error(field, 'a list of {"column": "[schema.]table.column", "action": "hash|mask|null|drop"}')
    out = []
    for r in rules:
        if not isinstance(r, dict) or set(r) - {"column", "action"} or not isinstance(r.get("column"), str) \
                or r.get("action") not in MASK_ACTIONS:
            raise _type_error(field, 'a list of {"column": "[schema.]table.column", "action": "hash|mask|null|drop"}')
        parts = r["column"].split(".")
        if not 2 <= len(parts) <= 3 or not all(parts):
            raise ApiError(400, "invalid_field", f"mask column {r['column']!r} must be table.column or "
                           "schema.table.column (* allowed).", {"field": field})
        out.append({"column": r["column"], "action": r["action"]})
    return out


def public_query(q: dict, v: dict | None) -> dict:
    out = {"name": q["name"], "connection_name": q["connection_name"], "description": q["description"],
           "published_version": q["published_version"], "latest_version": q["latest_version"],
           "cache_ttl": q["cache_ttl"], "created_at": q["created_at"], "updated_at": q["updated_at"],
           "published": q["published_version"] is not None}
    if v is not None:
        out.update(sql=v["sql"], parameters=v["parameters"], mask=v["mask"], allow_unsafe=v["allow_unsafe"],
                   version=v["version"])
    return out


def public_version(v: dict, q: dict) -> dict:
    return {"query": v["query_name"], "version": v["version"], "sql": v["sql"], "parameters": v["parameters"],
            "mask": v["mask"], "allow_unsafe": v["allow_unsafe"], "description": v["description"],
            "created_at": v["created_at"], "created_by": v["created_by"],
            "published": q["published_version"] == v["version"]}


def _version_from(app, body: dict, conn_name: str) -> dict:
    store = app.runtime.store
    crow = store.get_connection(conn_name)
    if crow is None:
        raise ApiError(404, "connection_not_found", f"There is no connection named '{conn_name}'.")
    sql = body.get("sql")
    if not isinstance(sql, str) or not sql.strip():
        raise _type_error("sql", "a non-empty SQL string")
    if len(sql) > 200_000:
        raise ApiError(400, "invalid_field", "sql is longer than 200,000 characters.", {"field": "sql"})
    plan_mod.check_statement(plan_mod.strip_sql(sql), crow["db"])
    parameters = P.normalize_specs(body.get("parameters"), sql, crow["db"])
    describe(app, crow, sql)
    desc = body.get("description") or ""
    if not isinstance(desc, str):
        raise _type_error("description", "a string")
    allow_unsafe = body.get("allow_unsafe", False)
    if not isinstance(allow_unsafe, bool):
        raise _type_error("allow_unsafe", "true or false")
    return {"sql": sql, "parameters": parameters, "description": desc, "mask": validate_mask(body.get("mask")),
            "allow_unsafe": allow_unsafe}


# What "this table or column does not exist" reads like from each database (PostgreSQL 42P01/42703, MySQL
# 1146/1054, SQLite, ClickHouse UNKNOWN_TABLE/UNKNOWN_IDENTIFIER): the one refusal made at save.
_UNKNOWN_OBJECT = re.compile(r'relation ".*" does not exist|column .* does not exist|missing FROM-clause entry|'
                             r"Table '.*' doesn't exist|Unknown column|no such table|no such column|"
                             r"UNKNOWN_TABLE|UNKNOWN_IDENTIFIER|Unknown table expression|Missing columns", re.I)
_DESCRIBED = ("select", "with", "insert", "update", "delete", "values", "table", "(")


def describe(app, crow: dict, sql: str) -> bool:
    """Have the connection's database plan the statement without running it (EXPLAIN, every marker a NULL), so an
    unknown table or column is a 400 at save instead of a 500 at the first caller. True when it was checked;
    False when it could not be (the connection is inactive or unreachable now, or the statement is not one that
    EXPLAIN takes): the statement is then saved unchecked, as before."""
    if not crow.get("active", True):
        return False
    neutral = P.neutralize(plan_mod.strip_sql(sql), crow["db"])
    head = neutral.lstrip().split(None, 1)[0].lower() if neutral.strip() else ""
    if not head.startswith(_DESCRIBED):
        return False
    from qag import connectors
    store = app.runtime.store
    try:
        conn = connectors.make(crow, store.connection_password(crow), app.cfg)
    except (ApiError, DomainError):
        return False
    try:
        driver_sql, names = P.compile_sql(plan_mod.strip_sql(sql), crow["db"])
        conn.run("EXPLAIN " + driver_sql, tuple(None for _ in names), write=False,
                 timeout=min(5.0, app.cfg.query_timeout), max_rows=1)
    except connectors.QueryFailed as exc:
        if not _UNKNOWN_OBJECT.search(exc.db_text or ""):
            return False  # refused for another reason (e.g. a type only a real value fixes): saved, as before
        raise ApiError(400, "invalid_sql", f"The database of connection '{crow['name']}' refuses this statement: "
                       f"{exc.db_text}", {"field": "sql"}) from None
    except (ApiError, DomainError):
        return False  # unreachable or slow right now: nothing to learn; the statement is saved unchecked
    finally:
        conn.close()
    return True


MAX_CACHE_TTL = 2 ** 31 - 1  # what every store's INTEGER holds (a larger one was a 500 from SQLite)


def _cache_ttl(body):
    v = body.get("cache_ttl")
    if v is not None and (isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= MAX_CACHE_TTL):
        raise _type_error("cache_ttl", f"a whole number of seconds from 0 to {MAX_CACHE_TTL}")
    return v


class Queries:
    def __init__(self, app):
        self.app = app

    def on_get(self, req, resp):
        require_admin(self.app, req)
        store = self.app.runtime.store
        items = []
        for q in store.list_queries():
            v = store.get_version(q["name"], q["published_version"] or q["latest_version"])
            items.append(public_query(q, v))
        ok(resp, list_page(items, req, "name"))

    def on_post(self, req, resp):
        p = require_admin(self.app, req)
        body = read_json(req, self.app.cfg)
        check_fields(body, QUERY_FIELDS, ("name", "connection_name", "sql"))
        name = check_name(body["name"], "name", "validate")
        conn_name = body["connection_name"]
        if not isinstance(conn_name, str):
            raise _type_error("connection_name", "a string")
        publish = body.get("publish", False)  # a draft unless publish is true, as in QueryAPIGate
        if not isinstance(publish, bool):
            raise _type_error("publish", "true or false")
        v = _version_from(self.app, body, conn_name)
        q = {"name": name, "connection_name": conn_name, "description": v["description"],
             "cache_ttl": _cache_ttl(body)}
        row = self.app.runtime.store.create_query(p.name, q, v, publish)
        self.app.runtime.changed("query", name)
        ok(resp, public_query(row, {**v, "version": 1}), 201)


class QueryValidate:
    """`POST /api/v1/queries/validate`: the checks a save makes, answered as data; never runs the statement and
    never fails for the body's content (an administrator still has to sign in)."""

    def __init__(self, app):
        self.app = app

    def on_post(self, req, resp):
        require_admin(self.app, req)
        errors: list[dict] = []
        out = {"valid": False, "errors": errors, "parameters": {}, "tables": []}
        try:
            body = read_json(req, self.app.cfg)
            check_fields(body, QUERY_FIELDS, ("connection_name", "sql"))
            if "name" in body:
                check_name(body["name"], "name", "validate")
            conn_name = body["connection_name"]
            if not isinstance(conn_name, str):
                raise _type_error("connection_name", "a string")
            _cache_ttl(body)
            v = _version_from(self.app, body, conn_name)
            out["parameters"] = v["parameters"]
            crow = self.app.runtime.store.get_connection(conn_name)
            out["tables"] = _tables_of(self.app, v["sql"], crow)
        except ApiError as err:
            errors.append({"code": err.code, "message": err.message, **({"field": err.extra["field"]}
                                                                        if err.extra.get("field") else {})})
        except Exception as exc:  # noqa: BLE001 - this route reports, it never fails
            errors.append({"code": "invalid_sql", "message": f"The statement could not be checked: {exc}"})
        out["valid"] = not errors
        ok(resp, out)


def _tables_of(app, sql: str, crow: dict) -> list[str]:
    from qag import connectors, governance
    from qag.governance import tables as gtables
    dialect = crow["db"]
    a = governance.analyze(P.neutralize(plan_mod.strip_sql(sql), dialect), dialect)
    default = connectors.make(crow, None, app.cfg).default_schema()  # no session is opened
    return sorted(gtables.table_text(t) for t in gtables.resolve(a.table_refs, dialect, default))


class Query:
    def __init__(self, app):
        self.app = app

    def on_get(self, req, resp, name):
        require_admin(self.app, req)
        store = self.app.runtime.store
        q = store.get_query(name)
        if q is None:
            raise ApiError(404, "query_not_found", f"There is no saved query named '{name}'.")
        v = store.get_version(name, q["published_version"] or q["latest_version"])
        out = public_query(q, v)
        out["versions"] = [public_version(x, q) for x in store.list_versions(name)]
        ok(resp, out)

    def on_delete(self, req, resp, name):
        p = require_admin(self.app, req)
        self.app.runtime.store.delete_query(p.name, name)
        self.app.runtime.changed("query", name)
        resp.status = falcon.HTTP_204


class QueryVersions:
    def __init__(self, app):
        self.app = app

    def on_get(self, req, resp, name):
        require_admin(self.app, req)
        store = self.app.runtime.store
        q = store.get_query(name)
        if q is None:
            raise ApiError(404, "query_not_found", f"There is no saved query named '{name}'.")
        ok(resp, list_page([public_version(v, q) for v in store.list_versions(name)], req, "version", numbered=True))

    def on_post(self, req, resp, name):
        p = require_admin(self.app, req)
        store = self.app.runtime.store
        body = read_json(req, self.app.cfg)
        check_fields(body, VERSION_FIELDS, ("sql",))
        q = store.get_query(name)
        if q is None:
            raise ApiError(404, "query_not_found", f"There is no saved query named '{name}'.")
        conn_name = body.get("connection_name", q["connection_name"])
        if not isinstance(conn_name, str):
            raise _type_error("connection_name", "a string")
        publish = body.get("publish", False)
        if not isinstance(publish, bool):
            raise _type_error("publish", "true or false")
        v = _version_from(self.app, body, conn_name)
        changes = {}
        if "connection_name" in body:
            changes["connection_name"] = conn_name
        if "cache_ttl" in body:
            changes["cache_ttl"] = _cache_ttl(body)
        if "description" in body:
            changes["description"] = v["description"]
        row = store.add_version(p.name, name, v, publish, changes)
        self.app.runtime.changed("query", name)
        vrow = store.get_version(name, row["latest_version"])
        ok(resp, public_version(vrow, row), 201)


class QueryPublish:
    def __init__(self, app):
        self.app = app

    def on_post(self, req, resp, name):
        p = require_admin(self.app, req)
        body = read_json(req, self.app.cfg)
        check_fields(body, ("version",), ("version",))
        version = body["version"]
        if isinstance(version, bool) or not isinstance(version, int) or not 1 <= version < 2 ** 63:
            raise _type_error("version", "a positive integer")
        out = self.app.runtime.store.publish(p.name, name, version)
        self.app.runtime.changed("query", name)
        v = self.app.runtime.store.get_version(name, version)
        ok(resp, public_query(out, v))


# -- API keys -------------------------------------------------------------------------------------
KEY_FIELDS = ("name", "description", "active", "expires_at", "role") + GRANT_FIELDS


def validate_grants(body: dict) -> dict:
    g = {}
    for f in ("queries", "connections", "allowed_tables", "allowed_write_ops"):
        if f in body:
            g[f] = _str_list(body, f)
    if g.get("allowed_write_ops"):
        bad = [o for o in g["allowed_write_ops"] if o.lower() not in WRITE_OPS]
        if bad:
            raise ApiError(400, "invalid_field", f"allowed_write_ops has unknown operations {', '.join(bad)}; use "
                           f"{', '.join(WRITE_OPS)}.", {"field": "allowed_write_ops"})
        g["allowed_write_ops"] = [o.lower() for o in g["allowed_write_ops"]]
    if g.get("allowed_tables"):
        for t in g["allowed_tables"]:
            if len(t.split(".")) > 2:
                raise ApiError(400, "invalid_field", f"allowed_tables entry {t!r} must be table or schema.table.",
                               {"field": "allowed_tables"})
    if "mask" in body:
        g["mask"] = validate_mask(body["mask"])
    if "allow_writes" in body:
        if not isinstance(body["allow_writes"], bool):
            raise _type_error("allow_writes", "true or false")
        g["allow_writes"] = body["allow_writes"]
    if "allowed_ips" in body:
        ips = _str_list(body, "allowed_ips")
        import ipaddress
        for ip in ips or []:
            try:
                ipaddress.ip_network(ip, strict=False)
            except ValueError:
                raise ApiError(400, "invalid_field", f"allowed_ips entry {ip!r} is not an IP address or CIDR network.",
                               {"field": "allowed_ips"}) from None
        g["allowed_ips"] = ips
    from qag import limits
    for field in ("rate_limit", "quota"):
        if field in body:
            value = body[field]
            if value is not None:
                try:
                    limits.parse(field, value)
                except ValueError as exc:
                    raise ApiError(400, "invalid_body", f"{exc}.", {"field": field}) from None
            g[field] = value
    for field in CALLER_LIMIT_FIELDS:
        if field in body:
            g[field] = caller_limit(field, body[field])
    return g


def caller_limit(field: str, value):
    """A key's or role's own max_rows, max_concurrent (positive integers) or query_timeout (a number of seconds,
    at least connectors.MIN_TIMEOUT); None is no limit of its own. Anything else: 400 invalid_body naming it."""
    if value is None:
        return None
    if field == "query_timeout":
        from qag.connectors import MIN_TIMEOUT
        if isinstance(value, int) and not isinstance(value, bool) and MIN_TIMEOUT <= value < 2 ** 63:
            return value  # (math.isfinite of a 400-digit JSON integer raised OverflowError: a 500)
        if isinstance(value, float) and math.isfinite(value) and value >= MIN_TIMEOUT:
            return value
        raise ApiError(400, "invalid_body", f"query_timeout must be a number of seconds, at least {MIN_TIMEOUT:g}, "
                       "or null for the server's.", {"field": field})
    if isinstance(value, int) and not isinstance(value, bool) and 1 <= value < 2 ** 63:
        return value
    raise ApiError(400, "invalid_body", f"{field} must be a positive integer, or null for no limit.",
                   {"field": field})


def _expires(body):
    """expires_at: an RFC 3339 time with its offset (or a date: midnight UTC); null for never. A time already past
    is kept: the key is expired from the start (401 as any expired key), which is how a caller tests that row."""
    if "expires_at" not in body or body["expires_at"] is None:
        return None
    try:
        return timeutil.fmt(timeutil.parse_input(body["expires_at"]))
    except ValueError as exc:
        raise ApiError(400, "invalid_field", f"expires_at: {exc}.", {"field": "expires_at"}) from None


class ApiKeys:
    def __init__(self, app):
        self.app = app

    def on_get(self, req, resp):
        require_admin(self.app, req)
        ok(resp, list_page([public_key(r) for r in self.app.runtime.store.list_keys()], req, "name"))

    def on_post(self, req, resp):
        p = require_admin(self.app, req)
        body = read_json(req, self.app.cfg)
        check_fields(body, KEY_FIELDS, ("name",))
        name = check_name(body["name"], "name")
        grants = validate_grants(body)
        if body.get("role") is not None:
            # A key made from a role: the role's grants, copied once now (later role edits do not reach it);
            # grants given in the body override the role's.
            from qag import identity
            if not isinstance(body["role"], str):
                raise _type_error("role", "the name of a role")
            role = identity.get_role(self.app.runtime.store, body["role"])
            if role is None:
                raise ApiError(404, "role_not_found", f"There is no role named '{body['role']}'.",
                               {"field": "role"})
            grants = {**{k: v for k, v in role["grants"].items() if k in GRANT_FIELDS}, **grants}
        for f in GRANT_FIELDS:
            grants.setdefault(f, None if f not in ("queries", "connections", "mask", "allow_writes") else
                              ([] if f != "allow_writes" else False))
        active = body.get("active", True)
        if not isinstance(active, bool):
            raise _type_error("active", "true or false")
        desc = body.get("description") or ""
        if not isinstance(desc, str):
            raise _type_error("description", "a string")
        row, secret = self.app.runtime.store.create_key(p.name, name, grants, active, _expires(body), desc)
        self.app.runtime.changed("key", name)
        ok(resp, {**public_key(row), "secret": secret}, 201, no_store=True)


class ApiKey:
    def __init__(self, app):
        self.app = app

    def on_get(self, req, resp, name):
        require_admin(self.app, req)
        row = self.app.runtime.store.get_key(name)
        if row is None:
            raise ApiError(404, "key_not_found", f"There is no API key named '{name}'.")
        ok(resp, public_key(row))

    def on_patch(self, req, resp, name):
        p = require_admin(self.app, req)
        body = read_json(req, self.app.cfg)
        check_fields(body, KEY_FIELDS)
        if "name" in body and body["name"] != name:
            raise ApiError(400, "invalid_field", "An API key cannot be renamed.", {"field": "name"})
        grants = validate_grants(body)
        fields = {}
        if "active" in body:
            if not isinstance(body["active"], bool):
                raise _type_error("active", "true or false")
            fields["active"] = body["active"]
        if "expires_at" in body:
            fields["expires_at"] = _expires(body)
        if "description" in body:
            if not isinstance(body["description"], str):
                raise _type_error("description", "a string")
            fields["description"] = body["description"]
        row = self.app.runtime.store.update_key(p.name, name, grants or None, fields)
        self.app.runtime.changed("key", name)
        ok(resp, public_key(row))

    def on_delete(self, req, resp, name):
        p = require_admin(self.app, req)
        self.app.runtime.store.delete_key(p.name, name)
        self.app.runtime.changed("key", name)
        resp.status = falcon.HTTP_204


class ApiKeyRotate:
    def __init__(self, app):
        self.app = app

    def on_post(self, req, resp, name):
        p = require_admin(self.app, req)
        body = read_json(req, self.app.cfg, allow_empty=True)
        check_fields(body, ("grace_minutes",))
        grace = body.get("grace_minutes", 60)  # QueryAPIGate's default: the old secret works for an hour
        if isinstance(grace, bool) or not isinstance(grace, (int, float)) or not 0 <= grace <= 60 * 24 * 30:
            raise _type_error("grace_minutes", "a number of minutes between 0 and 43200")
        row, secret = self.app.runtime.store.rotate_key(p.name, name, float(grace))
        self.app.runtime.changed("key", name)
        ok(resp, {**public_key(row), "secret": secret}, 200, no_store=True)


class Audit:
    def __init__(self, app):
        self.app = app

    def on_get(self, req, resp):
        require_admin(self.app, req)
        limit = list_limit(req, "the audit", 100)
        before = None
        cursor = req.params.get("cursor")
        if cursor:
            last = read_cursor(cursor)
            if not last.isdigit() or not 0 < int(last) < 2 ** 63:
                raise ApiError(400, "invalid_cursor", "cursor is not one this server gave.")
            before = int(last)
        rows = self.app.runtime.store.list_audit(limit + 1, before)
        nxt = make_cursor(str(rows[limit - 1]["id"])) if len(rows) > limit else None
        ok(resp, {"items": rows[:limit], "next_cursor": nxt})


def register(app) -> None:
    f = app.falcon
    f.add_route("/api/v1/connections", Connections(app))
    f.add_route("/api/v1/connections/test", ConnectionTest(app))
    f.add_route("/api/v1/connections/{name}", Connection(app))
    f.add_route("/api/v1/queries", Queries(app))
    f.add_route("/api/v1/queries/validate", QueryValidate(app))
    f.add_route("/api/v1/queries/{name}", Query(app))
    f.add_route("/api/v1/queries/{name}/versions", QueryVersions(app))
    f.add_route("/api/v1/queries/{name}/publish", QueryPublish(app))
    f.add_route("/api/v1/api-keys", ApiKeys(app))
    f.add_route("/api/v1/api-keys/{name}", ApiKey(app))
    f.add_route("/api/v1/api-keys/{name}/rotate", ApiKeyRotate(app))
    f.add_route("/api/v1/audit", Audit(app))
