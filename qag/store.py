"""The metadata store: connections, saved queries (immutable versions, a published pointer), API keys
(SHA-256 of the secret), administrators and the audit log; SQLite in QAG_HOME or PostgreSQL.

One SQL text serves both engines: statements are written with `?` markers (qmark), translated for psycopg2
(pyformat) by one rule, `pg_paramstyle`; the schema is qag/store_migrations.py, written per dialect. Refusals
and failures are domain errors (qag/errors.py: NotFound, Conflict, InUse, StoreUnavailable, SchemaTooNew),
never HTTP answers. Every change is one transaction that also writes its audit row; the caller bumps the
generations the change affects after commit and before acknowledging it (qag/runtime.py), and other hosts
apply it from its sequence number (qag/server/changes.py).
"""
from __future__ import annotations

import base64
import functools
import hashlib
import json
import os
import secrets
import sqlite3
import threading
from collections.abc import Iterable
from typing import Any

from qag import store_migrations, timeutil
from qag.errors import Conflict, DomainError, InUse, NotFound, SchemaTooNew, SecretKeyProblem, StoreUnavailable

try:  # the postgres extra
    import psycopg2
    import psycopg2.errors
except ImportError:  # pragma: no cover - SQLite-only installs
    psycopg2 = None  # type: ignore[assignment]


__all__ = ["Conflict", "InUse", "NotFound", "SchemaTooNew", "StoreUnavailable", "Store", "pg_paramstyle"]


PASSWORD_SHOWN = "********"
SECRET_FIELDS = ("password",)


def hash_secret(secret: str) -> str:
    return hashlib.sha256(secret.encode("utf-8")).hexdigest()


def new_key_secret() -> str:
    return "sk_" + secrets.token_urlsafe(32)


class PasswordBox:
    """Encrypts connection passwords at rest with Fernet when QAG_SECRET_KEY is set."""

    def __init__(self, secret_key: str):
        self._fernet = None
        if secret_key:
            from cryptography.fernet import Fernet
            raw = hashlib.sha256(secret_key.encode("utf-8")).digest()
            self._fernet = Fernet(base64.urlsafe_b64encode(raw))

    def seal(self, password: str | None) -> str | None:
        if password is None:
            return None
        if self._fernet is None:
            return "plain:" + password
        return "fernet:" + self._fernet.encrypt(password.encode("utf-8")).decode("ascii")

    def open(self, stored: str | None) -> str | None:
        if stored is None:
            return None
        kind, _, body = stored.partition(":")
        if kind == "plain":
            return body
        if kind == "fernet":
            if self._fernet is None:
                raise SecretKeyProblem("secret_key_missing", "This connection's password is encrypted; set "
                                       "QAG_SECRET_KEY to the key it was saved with.")
            from cryptography.fernet import InvalidToken
            try:
                return self._fernet.decrypt(body.encode("ascii")).decode("utf-8")
            except InvalidToken:
                raise SecretKeyProblem("secret_key_mismatch", "This connection's password was encrypted with a "
                                       "different QAG_SECRET_KEY.") from None
        return stored


class Store:
    """Thread-safe access to the metadata store: one DB-API connection per thread."""

    def __init__(self, *, home: str, database_url: str = "", secret_key: str = ""):
        self.home = home
        self.url = database_url
        self.is_pg = bool(database_url)
        self.box = PasswordBox(secret_key)
        self._local = threading.local()
        self._all: list[Any] = []
        self._lock = threading.Lock()
        self.statements = 0  # counted per process: tests prove a warm call reads nothing
        self.observer = None  # counts statements into qag_store_statements_total when set
        if not self.is_pg:
            os.makedirs(home, exist_ok=True)
            self.sqlite_path = os.path.join(home, "qag.db")

    # -- connections -------------------------------------------------------------------------
    def _connect(self):
        if self.is_pg:
            if psycopg2 is None:
                raise StoreUnavailable("psycopg2 is not installed: pip install 'qag[postgres]'")
            try:
                conn = psycopg2.connect(self.url, connect_timeout=3, application_name="qag-store")
            except psycopg2.OperationalError as exc:
                raise StoreUnavailable(f"cannot reach the metadata store at {_redact(self.url)}: "
                                       f"{str(exc).strip().splitlines()[0]}") from None
            conn.autocommit = False
            return conn
        conn = sqlite3.connect(self.sqlite_path, timeout=10, check_same_thread=False, isolation_level=None)
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute("PRAGMA synchronous=NORMAL")
        conn.execute("PRAGMA busy_timeout=10000")
        return conn

    def _conn(self):
        conn = getattr(self._local, "conn", None)
        if conn is None or (self.is_pg and conn.closed):
            conn = self._connect()
            self._local.conn = conn
            with self._lock:
                self._all.append(conn)
        return conn

    def close(self) -> None:
        with self._lock:
            for c in self._all:
                try:
                    c.close()
                except Exception:
                    pass
            self._all.clear()
        self._local = threading.local()

    @property
    def dialect(self) -> str:
        return "postgres" if self.is_pg else "sqlite"

    def _sql(self, sql: str) -> str:
        return pg_paramstyle(sql) if self.is_pg else sql

    @property
    def by_name(self) -> str:
        """ORDER BY for lists paged by name: code-point order, as the API's cursor compares names (Python str
        order). PostgreSQL would sort in the database's collation (en_US, ICU: case folded, punctuation
        ignored); "C" on UTF-8 is code-point order. SQLite's default BINARY collation already is."""
        return 'ORDER BY name COLLATE "C"' if self.is_pg else "ORDER BY name"

    def run(self, fn, *, write: bool = False):
        """Run fn(cursor) in one transaction; retry once on a dropped connection."""
        for attempt in (0, 1):
            conn = self._conn()
            try:
                if self.is_pg:
                    cur = conn.cursor()
                    try:
                        out = fn(_Cursor(self, cur))
                        conn.commit()
                    except Exception:
                        try:
                            conn.rollback()
                        except Exception:
                            pass
                        raise
                    finally:
                        try:
                            cur.close()
                        except Exception:
                            pass
                    return out
                cur = conn.cursor()
                cur.execute("BEGIN IMMEDIATE" if write else "BEGIN")
                try:
                    out = fn(_Cursor(self, cur))
                    cur.execute("COMMIT")
                except BaseException:
                    try:
                        cur.execute("ROLLBACK")
                    except Exception:
                        pass
                    raise
                return out
            except DomainError:  # a refusal, not a lost connection: no retry
                raise
            except Exception as exc:
                if _is_disconnect(exc):
                    self._local.conn = None
                    if attempt == 0:
                        continue
                    raise StoreUnavailable("the metadata store connection was lost") from None
                raise
        raise StoreUnavailable("the metadata store is unreachable")

    # -- schema ------------------------------------------------------------------------------
    def migrate(self) -> int:
        """Apply the migrations this store lacks (qag/store_migrations.py); the schema version after them. A store
        migrated by a newer qag is refused (SchemaTooNew): this one would write a schema it does not know."""
        def apply(cur: _Cursor) -> int:
            cur.execute(store_migrations.VERSION_TABLE)
            if self.is_pg:  # several workers or hosts may start together
                cur.execute("SELECT pg_advisory_xact_lock(715517)")
            cur.execute("SELECT COALESCE(MAX(version), 0) FROM qag_schema_version")
            current = cur.fetchone()[0]
            if current > store_migrations.LATEST:
                raise SchemaTooNew(current, store_migrations.LATEST)
            for m in store_migrations.MIGRATIONS:
                if m.version <= current:
                    continue
                for stmt in store_migrations.render(m, self.dialect):
                    cur.execute(stmt)
                cur.execute("INSERT INTO qag_schema_version VALUES (?, ?, ?)",
                            (m.version, m.description, timeutil.now_text()))
                current = m.version
            return current
        return self.run(apply, write=True)

    def ping(self) -> None:
        self.run(lambda c: c.execute("SELECT 1"))

    # -- generic helpers ---------------------------------------------------------------------
    def audit(self, cur: _Cursor, actor: str, action: str, entity: str, name: str,
              before: dict | None, after: dict | None) -> None:
        # The change's sequence number (migration 2): the counter row stays locked until this transaction
        # commits, so the next change gets the next number only after this one is visible (qag/server/changes.py).
        cur.execute("UPDATE qag_change_seq SET n = n + 1 WHERE id = 1")
        cur.execute("SELECT n FROM qag_change_seq WHERE id = 1")
        seq = cur.fetchone()[0]
        cur.execute("INSERT INTO qag_audit (at, actor, action, entity, name, before, after, seq) "
                    "VALUES (?,?,?,?,?,?,?,?)",
                    (timeutil.now_text(), actor, action, entity, name,
                     _dumps(_redact_row(before, after, "before")), _dumps(_redact_row(before, after, "after")), seq))
        if self.is_pg:  # other hosts on this store hear of it at commit (qag/server/changes.py)
            cur.execute("SELECT pg_notify('qag_changes', ?)", (f"{seq}:{entity}:{name}",))

    def change_position(self) -> int:
        """The sequence number of the last committed change (0: none yet)."""
        def q(cur):
            cur.execute("SELECT n FROM qag_change_seq WHERE id = 1")
            r = cur.fetchone()
            return int(r[0]) if r else 0
        return self.run(q)

    def changes_since(self, after_seq: int, limit: int = 1000) -> list[tuple[int, str, str]]:
        """(seq, entity, name) of the changes committed after sequence number after_seq, in commit order."""
        def q(cur):
            cur.execute("SELECT seq, entity, name FROM qag_audit WHERE seq > ? ORDER BY seq LIMIT ?",
                        (after_seq, limit))
            return [tuple(r) for r in cur.fetchall()]
        return self.run(q)

    def list_audit(self, limit: int = 100, before: int | None = None) -> list[dict]:
        """The newest audit rows first; `before`: only rows with a smaller id (the next page's cursor)."""
        def q(cur):
            if before is None:
                cur.execute("SELECT id, at, actor, action, entity, name, before, after FROM qag_audit "
                            "ORDER BY id DESC LIMIT ?", (limit,))
            else:
                cur.execute("SELECT id, at, actor, action, entity, name, before, after FROM qag_audit "
                            "WHERE id < ? ORDER BY id DESC LIMIT ?", (before, limit))
            return [dict(id=r[0], at=r[1], actor=r[2], action=r[3], entity=r[4], name=r[5],
                         before=_loads(r[6]), after=_loads(r[7])) for r in cur.fetchall()]
        return self.run(q)

    def kv_get_or_set(self, k: str, make) -> str:
        def q(cur):
            cur.execute("SELECT v FROM qag_kv WHERE k = ?", (k,))
            row = cur.fetchone()
            if row:
                return row[0]
            v = make()
            if self.is_pg:
                cur.execute("INSERT INTO qag_kv (k, v) VALUES (?, ?) ON CONFLICT (k) DO NOTHING", (k, v))
            else:
                cur.execute("INSERT OR IGNORE INTO qag_kv (k, v) VALUES (?, ?)", (k, v))
            cur.execute("SELECT v FROM qag_kv WHERE k = ?", (k,))
            return cur.fetchone()[0]
        return self.run(q, write=True)

    # -- connections -------------------------------------------------------------------------
    CONN_COLS = "name, db, host, port, username, password, dbname, active, options, created_at, updated_at"

    def _conn_row(self, r) -> dict:
        return dict(name=r[0], db=r[1], host=r[2], port=r[3], user=r[4], password_stored=r[5],
                    database=r[6], active=bool(r[7]), options=_loads(r[8]) or {}, created_at=r[9], updated_at=r[10])

    def get_connection(self, name: str) -> dict | None:
        def q(cur):
            cur.execute(f"SELECT {self.CONN_COLS} FROM qag_connections WHERE name = ?", (name,))
            r = cur.fetchone()
            return self._conn_row(r) if r else None
        return self.run(q)

    def list_connections(self) -> list[dict]:
        def q(cur):
            cur.execute(f"SELECT {self.CONN_COLS} FROM qag_connections {self.by_name}")
            return [self._conn_row(r) for r in cur.fetchall()]
        return self.run(q)

    def connection_password(self, row: dict) -> str | None:
        return self.box.open(row.get("password_stored"))

    def create_connection(self, actor: str, c: dict) -> dict:
        now = timeutil.now_text()

        def q(cur):
            cur.execute("SELECT 1 FROM qag_connections WHERE name = ?", (c["name"],))
            if cur.fetchone():
                raise Conflict()
            cur.execute(f"INSERT INTO qag_connections ({self.CONN_COLS}) VALUES (?,?,?,?,?,?,?,?,?,?,?)",
                        (c["name"], c["db"], c.get("host"), c.get("port"), c.get("user"),
                         self.box.seal(c.get("password")), c.get("database"), int(c.get("active", True)),
                         _dumps(c.get("options") or {}), now, now))
            cur.execute(f"SELECT {self.CONN_COLS} FROM qag_connections WHERE name = ?", (c["name"],))
            row = self._conn_row(cur.fetchone())
            self.audit(cur, actor, "create", "connection", c["name"], None, public_connection(row, True))
            return row
        try:
            return self.run(q, write=True)
        except Conflict:
            raise Conflict("connection_exists", f"A connection named '{c['name']}' exists; PATCH it or pick "
                           "another name.") from None

    def update_connection(self, actor: str, name: str, changes: dict) -> dict:
        def q(cur):
            cur.execute(f"SELECT {self.CONN_COLS} FROM qag_connections WHERE name = ?", (name,))
            r = cur.fetchone()
            if not r:
                raise NotFound("connection_not_found", f"There is no connection named '{name}'.")
            before = self._conn_row(r)
            cols = {"db": "db", "host": "host", "port": "port", "user": "username", "database": "dbname",
                    "active": "active", "options": "options", "password": "password"}
            sets, vals = [], []
            for field, value in changes.items():
                if field == "password":
                    value = self.box.seal(value)
                elif field == "options":
                    value = _dumps(value or {})
                elif field == "active":
                    value = int(bool(value))
                sets.append(f"{cols[field]} = ?")
                vals.append(value)
            sets.append("updated_at = ?")
            vals.append(timeutil.now_text())
            cur.execute(f"UPDATE qag_connections SET {', '.join(sets)} WHERE name = ?", (*vals, name))
            cur.execute(f"SELECT {self.CONN_COLS} FROM qag_connections WHERE name = ?", (name,))
            after = self._conn_row(cur.fetchone())
            b, a = public_connection(before, True), public_connection(after, True)
            if "password" in changes:
                b["password"], a["password"] = "(old)", "(changed)"
            self.audit(cur, actor, "update", "connection", name, b, a)
            return after
        return self.run(q, write=True)

    def delete_connection(self, actor: str, name: str) -> None:
        """NotFound, or InUse while saved queries still point at it."""
        def q(cur):
            cur.execute(f"SELECT {self.CONN_COLS} FROM qag_connections WHERE name = ?", (name,))
            r = cur.fetchone()
            if not r:
                raise NotFound("connection_not_found", f"There is no connection named '{name}'.")
            cur.execute("SELECT name FROM qag_queries WHERE connection_name = ? ORDER BY name", (name,))
            users = [x[0] for x in cur.fetchall()]
            if users:
                raise InUse("connection_in_use", f"Saved queries still use '{name}': {', '.join(users)}; delete or "
                            "move them first.", users)
            cur.execute("DELETE FROM qag_connections WHERE name = ?", (name,))
            self.audit(cur, actor, "delete", "connection", name, public_connection(self._conn_row(r), True), None)
        self.run(q, write=True)

    # -- queries -----------------------------------------------------------------------------
    Q_COLS = ("name, connection_name, description, published_version, cache_ttl, latest_version, created_at, "
              "updated_at, created_by")
    V_COLS = "query_name, version, sql_text, parameters, mask, allow_unsafe, description, created_at, created_by"

    def _q_row(self, r) -> dict:
        return dict(name=r[0], connection_name=r[1], description=r[2], published_version=r[3], cache_ttl=r[4],
                    latest_version=r[5], created_at=r[6], updated_at=r[7], created_by=r[8])

    def _v_row(self, r) -> dict:
        return dict(query_name=r[0], version=r[1], sql=r[2], parameters=_loads(r[3]) or {}, mask=_loads(r[4]) or [],
                    allow_unsafe=bool(r[5]), description=r[6], created_at=r[7], created_by=r[8])

    def get_query(self, name: str) -> dict | None:
        def q(cur):
            cur.execute(f"SELECT {self.Q_COLS} FROM qag_queries WHERE name = ?", (name,))
            r = cur.fetchone()
            return self._q_row(r) if r else None
        return self.run(q)

    def list_queries(self) -> list[dict]:
        def q(cur):
            cur.execute(f"SELECT {self.Q_COLS} FROM qag_queries {self.by_name}")
            return [self._q_row(r) for r in cur.fetchall()]
        return self.run(q)

    def get_version(self, name: str, version: int) -> dict | None:
        def q(cur):
            cur.execute(f"SELECT {self.V_COLS} FROM qag_query_versions WHERE query_name = ? AND version = ?",
                        (name, version))
            r = cur.fetchone()
            return self._v_row(r) if r else None
        return self.run(q)

    def list_versions(self, name: str) -> list[dict]:
        def q(cur):
            cur.execute(f"SELECT {self.V_COLS} FROM qag_query_versions WHERE query_name = ? ORDER BY version",
                        (name,))
            return [self._v_row(r) for r in cur.fetchall()]
        return self.run(q)

    def create_query(self, actor: str, q_: dict, v: dict, publish: bool) -> dict:
        now = timeutil.now_text()

        def q(cur):
            cur.execute("SELECT 1 FROM qag_queries WHERE name = ?", (q_["name"],))
            if cur.fetchone():
                raise Conflict()
            cur.execute(f"INSERT INTO qag_queries ({self.Q_COLS}) VALUES (?,?,?,?,?,?,?,?,?)",
                        (q_["name"], q_["connection_name"], q_.get("description", ""), 1 if publish else None,
                         q_.get("cache_ttl"), 1, now, now, actor))
            self._insert_version(cur, q_["name"], 1, v, now, actor)
            self.audit(cur, actor, "create", "query", q_["name"], None,
                       {**q_, "version": 1, "sql": v["sql"], "published_version": 1 if publish else None})
            cur.execute(f"SELECT {self.Q_COLS} FROM qag_queries WHERE name = ?", (q_["name"],))
            return self._q_row(cur.fetchone())
        try:
            return self.run(q, write=True)
        except Conflict:
            name = q_["name"]
            raise Conflict("query_exists", f"A query named '{name}' exists; add a version with POST "
                           f"/api/v1/queries/{name}/versions.") from None

    def _insert_version(self, cur, name, version, v, now, actor):
        cur.execute(f"INSERT INTO qag_query_versions ({self.V_COLS}) VALUES (?,?,?,?,?,?,?,?,?)",
                    (name, version, v["sql"], _dumps(v.get("parameters") or {}), _dumps(v.get("mask") or []),
                     int(bool(v.get("allow_unsafe"))), v.get("description", ""), now, actor))

    def add_version(self, actor: str, name: str, v: dict, publish: bool, changes: dict) -> dict:
        now = timeutil.now_text()

        def q(cur):
            cur.execute(f"SELECT {self.Q_COLS} FROM qag_queries WHERE name = ?", (name,))
            r = cur.fetchone()
            if not r:
                raise NotFound("query_not_found", f"There is no saved query named '{name}'.")
            before = self._q_row(r)
            version = before["latest_version"] + 1
            self._insert_version(cur, name, version, v, now, actor)
            sets = ["latest_version = ?", "updated_at = ?"]
            vals: list[Any] = [version, now]
            if publish:
                sets.append("published_version = ?")
                vals.append(version)
            for f in ("connection_name", "description", "cache_ttl"):
                if f in changes:
                    sets.append(f"{f} = ?")
                    vals.append(changes[f])
            cur.execute(f"UPDATE qag_queries SET {', '.join(sets)} WHERE name = ?", (*vals, name))
            cur.execute(f"SELECT {self.Q_COLS} FROM qag_queries WHERE name = ?", (name,))
            after = self._q_row(cur.fetchone())
            self.audit(cur, actor, "add_version", "query", name, before, {**after, "sql": v["sql"]})
            return after
        return self.run(q, write=True)

    def publish(self, actor: str, name: str, version: int) -> dict:
        def q(cur):
            cur.execute(f"SELECT {self.Q_COLS} FROM qag_queries WHERE name = ?", (name,))
            r = cur.fetchone()
            if not r:
                raise NotFound("query_not_found", f"There is no saved query named '{name}'.")
            cur.execute("SELECT 1 FROM qag_query_versions WHERE query_name = ? AND version = ?", (name, version))
            if not cur.fetchone():
                raise NotFound("version_not_found", f"The query '{name}' has no version {version}.")
            before = self._q_row(r)
            cur.execute("UPDATE qag_queries SET published_version = ?, updated_at = ? WHERE name = ?",
                        (version, timeutil.now_text(), name))
            cur.execute(f"SELECT {self.Q_COLS} FROM qag_queries WHERE name = ?", (name,))
            after = self._q_row(cur.fetchone())
            self.audit(cur, actor, "publish", "query", name, before, after)
            return after
        return self.run(q, write=True)

    def delete_query(self, actor: str, name: str) -> None:
        def q(cur):
            cur.execute(f"SELECT {self.Q_COLS} FROM qag_queries WHERE name = ?", (name,))
            r = cur.fetchone()
            if not r:
                raise NotFound("query_not_found", f"There is no saved query named '{name}'.")
            cur.execute("DELETE FROM qag_query_versions WHERE query_name = ?", (name,))
            cur.execute("DELETE FROM qag_queries WHERE name = ?", (name,))
            self.audit(cur, actor, "delete", "query", name, self._q_row(r), None)
        self.run(q, write=True)

    # -- API keys ----------------------------------------------------------------------------
    K_COLS = ("name, key_hash, prefix, grants, active, expires_at, prev_hash, prev_valid_until, description, "
              "created_at, updated_at, rotated_at")

    def _k_row(self, r) -> dict:
        return dict(name=r[0], key_hash=r[1], prefix=r[2], grants=_loads(r[3]) or {}, active=bool(r[4]),
                    expires_at=r[5], prev_hash=r[6], prev_valid_until=r[7], description=r[8],
                    created_at=r[9], updated_at=r[10], rotated_at=r[11])

    def get_key(self, name: str) -> dict | None:
        def q(cur):
            cur.execute(f"SELECT {self.K_COLS} FROM qag_api_keys WHERE name = ?", (name,))
            r = cur.fetchone()
            return self._k_row(r) if r else None
        return self.run(q)

    def find_key_by_hash(self, key_hash: str) -> tuple[dict | None, bool]:
        """(row, via_previous_secret)."""
        def q(cur):
            cur.execute(f"SELECT {self.K_COLS} FROM qag_api_keys WHERE key_hash = ?", (key_hash,))
            r = cur.fetchone()
            if r:
                return self._k_row(r), False
            cur.execute(f"SELECT {self.K_COLS} FROM qag_api_keys WHERE prev_hash = ?", (key_hash,))
            r = cur.fetchone()
            return (self._k_row(r), True) if r else (None, False)
        return self.run(q)

    def list_keys(self) -> list[dict]:
        def q(cur):
            cur.execute(f"SELECT {self.K_COLS} FROM qag_api_keys {self.by_name}")
            return [self._k_row(r) for r in cur.fetchall()]
        return self.run(q)

    def create_key(self, actor: str, name: str, grants: dict, active: bool, expires_at: str | None,
                   description: str) -> tuple[dict, str]:
        secret = new_key_secret()
        now = timeutil.now_text()

        def q(cur):
            cur.execute("SELECT 1 FROM qag_api_keys WHERE name = ?", (name,))
            if cur.fetchone():
                raise Conflict()
            cur.execute(f"INSERT INTO qag_api_keys ({self.K_COLS}) VALUES (?,?,?,?,?,?,?,?,?,?,?,?)",
                        (name, hash_secret(secret), secret[:7], _dumps(grants), int(active), expires_at,
                         None, None, description, now, now, None))
            cur.execute(f"SELECT {self.K_COLS} FROM qag_api_keys WHERE name = ?", (name,))
            row = self._k_row(cur.fetchone())
            self.audit(cur, actor, "create", "api_key", name, None, public_key(row))
            return row
        try:
            return self.run(q, write=True), secret
        except Conflict:
            raise Conflict("key_exists", f"An API key named '{name}' exists; PATCH it, rotate it or pick another "
                           "name.") from None

    def update_key(self, actor: str, name: str, grants: dict | None, fields: dict) -> dict:
        def q(cur):
            cur.execute(f"SELECT {self.K_COLS} FROM qag_api_keys WHERE name = ?", (name,))
            r = cur.fetchone()
            if not r:
                raise NotFound("key_not_found", f"There is no API key named '{name}'.")
            before = self._k_row(r)
            sets, vals = ["updated_at = ?"], [timeutil.now_text()]
            if grants is not None:
                sets.append("grants = ?")
                vals.append(_dumps({**before["grants"], **grants}))
            for f, v in fields.items():
                sets.append(f"{f} = ?")
                vals.append(int(v) if f == "active" else v)
            cur.execute(f"UPDATE qag_api_keys SET {', '.join(sets)} WHERE name = ?", (*vals, name))
            cur.execute(f"SELECT {self.K_COLS} FROM qag_api_keys WHERE name = ?", (name,))
            after = self._k_row(cur.fetchone())
            self.audit(cur, actor, "update", "api_key", name, public_key(before), public_key(after))
            return after
        return self.run(q, write=True)

    def rotate_key(self, actor: str, name: str, grace_minutes: float) -> tuple[dict, str]:
        secret = new_key_secret()
        now = timeutil.now()

        def q(cur):
            cur.execute(f"SELECT {self.K_COLS} FROM qag_api_keys WHERE name = ?", (name,))
            r = cur.fetchone()
            if not r:
                raise NotFound("key_not_found", f"There is no API key named '{name}'.")
            before = self._k_row(r)
            import datetime as _dt
            until = timeutil.fmt(now + _dt.timedelta(minutes=grace_minutes)) if grace_minutes > 0 else None
            cur.execute("UPDATE qag_api_keys SET key_hash = ?, prefix = ?, prev_hash = ?, prev_valid_until = ?, "
                        "rotated_at = ?, updated_at = ? WHERE name = ?",
                        (hash_secret(secret), secret[:7], before["key_hash"] if until else None, until,
                         timeutil.fmt(now), timeutil.fmt(now), name))
            cur.execute(f"SELECT {self.K_COLS} FROM qag_api_keys WHERE name = ?", (name,))
            after = self._k_row(cur.fetchone())
            b, a = public_key(before), public_key(after)
            b["secret"], a["secret"] = "(old)", "(changed)"
            self.audit(cur, actor, "rotate", "api_key", name, b, a)
            return after
        return self.run(q, write=True), secret

    def delete_key(self, actor: str, name: str) -> dict:
        def q(cur):
            cur.execute(f"SELECT {self.K_COLS} FROM qag_api_keys WHERE name = ?", (name,))
            r = cur.fetchone()
            if not r:
                raise NotFound("key_not_found", f"There is no API key named '{name}'.")
            row = self._k_row(r)
            cur.execute("DELETE FROM qag_api_keys WHERE name = ?", (name,))
            self.audit(cur, actor, "delete", "api_key", name, public_key(row), None)
            return row
        return self.run(q, write=True)

    # -- administrators ----------------------------------------------------------------------
    def create_admin(self, name: str) -> str:
        token = "qa_" + secrets.token_urlsafe(32)

        def q(cur):
            cur.execute("SELECT 1 FROM qag_admins WHERE name = ?", (name,))
            if cur.fetchone():
                raise Conflict()
            cur.execute("INSERT INTO qag_admins (name, token_hash, active, created_at) VALUES (?,?,?,?)",
                        (name, hash_secret(token), 1, timeutil.now_text()))
            self.audit(cur, "cli", "create", "admin", name, None, {"name": name, "token": "(set)"})
            return token
        try:
            return self.run(q, write=True)
        except Conflict:
            raise Conflict("admin_exists", f"An administrator named '{name}' exists.") from None

    def find_admin(self, token_hash: str) -> str | None:
        def q(cur):
            cur.execute("SELECT name FROM qag_admins WHERE token_hash = ? AND active = 1", (token_hash,))
            r = cur.fetchone()
            return r[0] if r else None
        return self.run(q)

    def list_admins(self) -> list[dict]:
        """Named administrators, oldest first: name, active, created_at (never the token)."""
        def q(cur):
            cur.execute("SELECT name, active, created_at FROM qag_admins ORDER BY created_at, name")
            return [{"name": r[0], "active": bool(r[1]), "created_at": r[2]} for r in cur.fetchall()]
        return self.run(q)

    def revoke_admin(self, name: str) -> bool:
        def q(cur):
            cur.execute("UPDATE qag_admins SET active = 0 WHERE name = ?", (name,))
            ok = cur.rowcount > 0
            if ok:
                self.audit(cur, "cli", "revoke", "admin", name, {"active": True}, {"active": False})
            return ok
        return self.run(q, write=True)


_PG_CACHE_SIZE = 512  # the store's statements are a few dozen texts (the column sets of an UPDATE vary)


@functools.lru_cache(maxsize=_PG_CACHE_SIZE)
def pg_paramstyle(sql: str) -> str:
    """A statement written with `?` markers (DB-API qmark, SQLite's) in psycopg2's pyformat: each `?` that is a
    marker becomes `%s`, and every `%` becomes `%%`, since psycopg2 reads `%` anywhere in the text once it is
    given parameters (the store always gives a tuple). A `?` is no marker inside a string literal ('…', E'…'
    with backslash escapes), a quoted identifier ("…"), a dollar-quoted body ($tag$…$tag$) or a comment
    (`--` to the line's end, `/* … */`, nested as PostgreSQL nests them)."""
    out: list[str] = []
    i, n = 0, len(sql)
    while i < n:
        ch = sql[i]
        if ch == "?":
            out.append("%s")
            i += 1
            continue
        if ch == "%":
            out.append("%%")
            i += 1
            continue
        end = i + 1
        if ch == "'" or ch == '"':
            backslash = ch == "'" and i > 0 and sql[i - 1] in "eE" and (i < 2 or not _ident_char(sql[i - 2]))
            end = _quoted_end(sql, i, ch, backslash)
        elif sql.startswith("--", i):
            nl = sql.find("\n", i)
            end = n if nl < 0 else nl
        elif sql.startswith("/*", i):
            end = _block_comment_end(sql, i)
        elif ch == "$" and (i == 0 or not _ident_char(sql[i - 1])):
            tag_end = sql.find("$", i + 1)
            tag = sql[i:tag_end + 1] if tag_end > 0 else ""
            if tag and all(_ident_char(c) for c in tag[1:-1]) and not tag[1:2].isdigit():
                close = sql.find(tag, tag_end + 1)
                end = n if close < 0 else close + len(tag)
        out.append(sql[i:end].replace("%", "%%"))
        i = end
    return "".join(out)


def _ident_char(c: str) -> bool:
    return c.isalnum() or c == "_"


def _quoted_end(sql: str, i: int, quote: str, backslash: bool) -> int:
    j, n = i + 1, len(sql)
    while j < n:
        c = sql[j]
        if backslash and c == "\\":
            j += 2
            continue
        if c == quote:
            if j + 1 < n and sql[j + 1] == quote:  # a doubled quote is one quote character
                j += 2
                continue
            return j + 1
        j += 1
    return n


def _block_comment_end(sql: str, i: int) -> int:
    depth, j, n = 0, i, len(sql)
    while j < n:
        if sql.startswith("/*", j):
            depth += 1
            j += 2
        elif sql.startswith("*/", j):
            depth -= 1
            j += 2
            if depth == 0:
                return j
        else:
            j += 1
    return n


class _Cursor:
    """A cursor that writes `?` markers in the store's dialect (pg_paramstyle) and counts statements.

    A value holding a NUL character matches nothing the store keeps (every name and text is refused with one when
    it is saved), and PostgreSQL's text cannot even be compared with one (psycopg2 raises): a statement other than
    an INSERT given such a value is not sent, and reads as no rows (a lookup of `/api/v1/keys/a%00b` is a 404 on
    either store, not a 500 on PostgreSQL)."""
    __slots__ = ("_store", "_cur", "_none")

    def __init__(self, store: Store, cur):
        self._store = store
        self._cur = cur
        self._none = False

    def execute(self, sql: str, params: Iterable = ()):
        self._store.statements += 1
        obs = self._store.observer
        if obs is not None:
            obs.store_statement()
        params = tuple(params)
        self._none = any(p.__class__ is str and "\x00" in p for p in params) and \
            not sql.lstrip()[:6].upper().startswith("INSERT")
        if self._none:
            return None
        try:
            return self._cur.execute(self._store._sql(sql), params)
        except sqlite3.IntegrityError:
            raise Conflict() from None
        except Exception as exc:
            if psycopg2 is not None and isinstance(exc, psycopg2.errors.UniqueViolation):
                raise Conflict() from None
            raise

    def fetchone(self):
        return None if self._none else self._cur.fetchone()

    def fetchall(self):
        return [] if self._none else self._cur.fetchall()

    @property
    def rowcount(self):
        return 0 if self._none else self._cur.rowcount


def _is_disconnect(exc: Exception) -> bool:
    if psycopg2 is not None and isinstance(exc, (psycopg2.OperationalError, psycopg2.InterfaceError)):
        return True
    return isinstance(exc, sqlite3.OperationalError) and "unable to open" in str(exc)


def _redact(url: str) -> str:
    import re
    return re.sub(r"(://[^:/@]+):[^@]*@", r"\1:********@", url)


def _dumps(v) -> str | None:
    return None if v is None else json.dumps(v, sort_keys=True, separators=(",", ":"))


def _loads(v):
    return None if v is None else json.loads(v)


def _redact_row(before, after, which):
    row = before if which == "before" else after
    if row is None:
        return None
    out = dict(row)
    for f in SECRET_FIELDS:
        if f in out and out[f] not in (None, "(old)", "(changed)"):
            out[f] = PASSWORD_SHOWN
    out.pop("password_stored", None)
    out.pop("key_hash", None)
    out.pop("prev_hash", None)
    return out


def public_connection(row: dict, _audit: bool = False) -> dict:
    return {"name": row["name"], "db": row["db"], "host": row["host"], "port": row["port"], "user": row["user"],
            "password": PASSWORD_SHOWN if row.get("password_stored") else None, "database": row["database"],
            "active": row["active"], "options": row["options"], "created_at": row["created_at"],
            "updated_at": row["updated_at"]}


GRANT_FIELDS = ("queries", "connections", "allowed_tables", "mask", "allow_writes", "allowed_write_ops",
                "allowed_ips", "rate_limit", "quota", "max_rows", "query_timeout", "max_concurrent")
# A caller's own limits (issue 18 part 5, as QueryAPIGate's): each narrows the server's, null is none. They are
# checked by qag/http/data.py and qag/capacity.py; a key carrying one is served by Python only (qag/auth.py).
CALLER_LIMIT_FIELDS = ("max_rows", "query_timeout", "max_concurrent")


def public_key(row: dict) -> dict:
    g = row["grants"]
    out = {"name": row["name"], "prefix": row["prefix"], "active": row["active"], "expires_at": row["expires_at"],
           "description": row.get("description", "")}
    for f in GRANT_FIELDS:
        out[f] = g.get(f)
    out.update(created_at=row["created_at"], updated_at=row["updated_at"], rotated_at=row.get("rotated_at"),
               previous_secret_valid_until=row.get("prev_valid_until"))
    return out
