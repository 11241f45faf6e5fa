"""The metadata store: connections, saved queries (immutable versions, a published pointer), API keys
(SHA-256 of the secret), administrators and the audit log; SQLite in QAG_HOME or PostgreSQL.

One SQL text serves both engines: statements are written with `?` markers and translated to `%s` for
psycopg2. Every change is one transaction that also writes its audit row; the caller bumps the
generations the change affects after commit and before acknowledging it (qag/runtime.py), and other hosts
apply it from its sequence number (qag/server/changes.py).
"""
from __future__ import annotations

import base64
import hashlib
import json
import os
import secrets
import sqlite3
import threading
from typing import Any, Iterable

from qag import timeutil
from qag.errors import ApiError, Conflict, StoreUnavailable

try:  # the postgres extra
    import psycopg2
    import psycopg2.errors
except ImportError:  # pragma: no cover - SQLite-only installs
    psycopg2 = None  # type: ignore[assignment]


MIGRATIONS: tuple[tuple[int, str, tuple[str | tuple[str, str], ...]], ...] = (
    (1, "initial schema", (
        """CREATE TABLE IF NOT EXISTS qag_connections (
            name TEXT PRIMARY KEY, db TEXT NOT NULL, host TEXT, port INTEGER, username TEXT,
            password TEXT, dbname TEXT, active INTEGER NOT NULL DEFAULT 1, options TEXT NOT NULL DEFAULT '{}',
            created_at TEXT NOT NULL, updated_at TEXT NOT NULL)""",
        """CREATE TABLE IF NOT EXISTS qag_queries (
            name TEXT PRIMARY KEY, connection_name TEXT NOT NULL, description TEXT NOT NULL DEFAULT '',
            published_version INTEGER, cache_ttl INTEGER, latest_version INTEGER NOT NULL DEFAULT 0,
            created_at TEXT NOT NULL, updated_at TEXT NOT NULL, created_by TEXT)""",
        """CREATE TABLE IF NOT EXISTS qag_query_versions (
            query_name TEXT NOT NULL, version INTEGER NOT NULL, sql_text TEXT NOT NULL,
            parameters TEXT NOT NULL DEFAULT '{}', mask TEXT NOT NULL DEFAULT '[]',
            allow_unsafe INTEGER NOT NULL DEFAULT 0, description TEXT NOT NULL DEFAULT '',
            created_at TEXT NOT NULL, created_by TEXT, PRIMARY KEY (query_name, version))""",
        """CREATE TABLE IF NOT EXISTS qag_api_keys (
            name TEXT PRIMARY KEY, key_hash TEXT NOT NULL UNIQUE, prefix TEXT NOT NULL,
            grants TEXT NOT NULL, active INTEGER NOT NULL DEFAULT 1, expires_at TEXT,
            prev_hash TEXT, prev_valid_until TEXT, description TEXT NOT NULL DEFAULT '',
            created_at TEXT NOT NULL, updated_at TEXT NOT NULL, rotated_at TEXT)""",
        "CREATE INDEX IF NOT EXISTS qag_api_keys_prev ON qag_api_keys (prev_hash)",
        """CREATE TABLE IF NOT EXISTS qag_admins (
            name TEXT PRIMARY KEY, token_hash TEXT NOT NULL UNIQUE, active INTEGER NOT NULL DEFAULT 1,
            created_at TEXT NOT NULL)""",
        """CREATE TABLE IF NOT EXISTS qag_audit (
            id INTEGER PRIMARY KEY, at TEXT NOT NULL, actor TEXT NOT NULL, action TEXT NOT NULL,
            entity TEXT NOT NULL, name TEXT NOT NULL, before TEXT, after TEXT)""",
        """CREATE TABLE IF NOT EXISTS qag_kv (k TEXT PRIMARY KEY, v TEXT NOT NULL)""",
    )),
    # Audit ids are assigned at insert, so on PostgreSQL a smaller id may commit after a larger one: a watcher
    # that remembers "applied up to id N" could skip a change for good. Every change now also takes the next
    # number of one counter row, whose row lock it holds to its commit: numbers commit in order, with no gaps.
    (2, "change sequence numbers, committed in order", (
        "CREATE TABLE IF NOT EXISTS qag_change_seq (id INTEGER PRIMARY KEY, n BIGINT NOT NULL)",
        "INSERT INTO qag_change_seq (id, n) SELECT 1, COALESCE(MAX(id), 0) FROM qag_audit",
        "ALTER TABLE qag_audit ADD COLUMN seq BIGINT",
        "UPDATE qag_audit SET seq = id",
        "CREATE UNIQUE INDEX IF NOT EXISTS qag_audit_seq ON qag_audit (seq)",
    )),
    # A writer that does not number its change itself (a host still on the previous version during an upgrade,
    # a script inserting its audit row) gets the next number from the store, so no watcher can miss it.
    (3, "audit rows without a sequence number get the next one", (
        ("pg", """CREATE OR REPLACE FUNCTION qag_audit_number() RETURNS trigger LANGUAGE plpgsql AS $$
            BEGIN
                IF NEW.seq IS NULL THEN
                    UPDATE qag_change_seq SET n = n + 1 WHERE id = 1 RETURNING n INTO NEW.seq;
                END IF;
                RETURN NEW;
            END $$"""),
        ("pg", "CREATE TRIGGER qag_audit_number BEFORE INSERT ON qag_audit FOR EACH ROW "
               "EXECUTE FUNCTION qag_audit_number()"),
        ("sqlite", """CREATE TRIGGER IF NOT EXISTS qag_audit_number AFTER INSERT ON qag_audit
            WHEN NEW.seq IS NULL
            BEGIN
                UPDATE qag_change_seq SET n = n + 1 WHERE id = 1;
                UPDATE qag_audit SET seq = (SELECT n FROM qag_change_seq WHERE id = 1) WHERE id = NEW.id;
            END"""),
    )),
)

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
                raise ApiError(500, "secret_key_missing",
                               "This connection's password is encrypted; set QAG_SECRET_KEY to the key it was saved with.")
            from cryptography.fernet import InvalidToken
            try:
                return self._fernet.decrypt(body.encode("ascii")).decode("utf-8")
            except InvalidToken:
                raise ApiError(500, "secret_key_mismatch",
                               "This connection's password was encrypted with a different QAG_SECRET_KEY.") from None
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

    def _sql(self, sql: str) -> str:
        return sql.replace("?", "%s") if self.is_pg else sql

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
            except (ApiError, Conflict, StoreUnavailable):
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
        def apply(cur: _Cursor) -> int:
            cur.execute("CREATE TABLE IF NOT EXISTS qag_schema_version (version INTEGER PRIMARY KEY, "
                        "description TEXT NOT NULL, applied_at TEXT NOT NULL)")
            if self.is_pg:  # several workers or hosts may start together
                cur.execute("SELECT pg_advisory_xact_lock(715517)")
            cur.execute("SELECT COALESCE(MAX(version), 0) FROM qag_schema_version")
            current = cur.fetchone()[0]
            for version, desc, statements in MIGRATIONS:
                if version <= current:
                    continue
                for stmt in statements:
                    if isinstance(stmt, tuple):  # (engine, statement): for one engine only
                        engine, stmt = stmt
                        if engine != ("pg" if self.is_pg else "sqlite"):
                            continue
                    if self.is_pg:
                        stmt = stmt.replace("INTEGER PRIMARY KEY, at", "BIGSERIAL PRIMARY KEY, at")
                    cur.execute(stmt)
                cur.execute("INSERT INTO qag_schema_version VALUES (?, ?, ?)", (version, desc, timeutil.now_text()))
                current = version
            return current
        return self.run(apply, write=True)

    def ping(self) -> None:
        self.run(lambda c: c.execute("SELECT 1"))

    # -- generic helpers ---------------------------------------------------------------------
    def audit(self, cur: "_Cursor", actor: str, action: str, entity: str, name: str,
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

    def list_audit(self, limit: int = 100) -> list[dict]:
        def q(cur):
            cur.execute("SELECT id, at, actor, action, entity, name, before, after FROM qag_audit "
                        "ORDER BY id DESC LIMIT ?", (limit,))
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
        return self.run(q, write=True)

    def update_connection(self, actor: str, name: str, changes: dict) -> dict | None:
        def q(cur):
            cur.execute(f"SELECT {self.CONN_COLS} FROM qag_connections WHERE name = ?", (name,))
            r = cur.fetchone()
            if not r:
                return None
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

    def delete_connection(self, actor: str, name: str) -> str:
        """'ok', 'missing', or 'in_use' (saved queries still point at it)."""
        def q(cur):
            cur.execute(f"SELECT {self.CONN_COLS} FROM qag_connections WHERE name = ?", (name,))
            r = cur.fetchone()
            if not r:
                return "missing"
            cur.execute("SELECT name FROM qag_queries WHERE connection_name = ? ORDER BY name", (name,))
            users = [x[0] for x in cur.fetchall()]
            if users:
                return "in_use:" + ", ".join(users)
            cur.execute("DELETE FROM qag_connections WHERE name = ?", (name,))
            self.audit(cur, actor, "delete", "connection", name, public_connection(self._conn_row(r), True), None)
            return "ok"
        return self.run(q, write=True)

    # -- queries -----------------------------------------------------------------------------
    Q_COLS = "name, connection_name, description, published_version, cache_ttl, latest_version, created_at, updated_at, created_by"
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
        return self.run(q, write=True)

    def _insert_version(self, cur, name, version, v, now, actor):
        cur.execute(f"INSERT INTO qag_query_versions ({self.V_COLS}) VALUES (?,?,?,?,?,?,?,?,?)",
                    (name, version, v["sql"], _dumps(v.get("parameters") or {}), _dumps(v.get("mask") or []),
                     int(bool(v.get("allow_unsafe"))), v.get("description", ""), now, actor))

    def add_version(self, actor: str, name: str, v: dict, publish: bool, changes: dict) -> dict | None:
        now = timeutil.now_text()

        def q(cur):
            cur.execute(f"SELECT {self.Q_COLS} FROM qag_queries WHERE name = ?", (name,))
            r = cur.fetchone()
            if not r:
                return None
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

    def publish(self, actor: str, name: str, version: int) -> str | dict:
        def q(cur):
            cur.execute(f"SELECT {self.Q_COLS} FROM qag_queries WHERE name = ?", (name,))
            r = cur.fetchone()
            if not r:
                return "missing"
            cur.execute("SELECT 1 FROM qag_query_versions WHERE query_name = ? AND version = ?", (name, version))
            if not cur.fetchone():
                return "no_version"
            before = self._q_row(r)
            cur.execute("UPDATE qag_queries SET published_version = ?, updated_at = ? WHERE name = ?",
                        (version, timeutil.now_text(), name))
            cur.execute(f"SELECT {self.Q_COLS} FROM qag_queries WHERE name = ?", (name,))
            after = self._q_row(cur.fetchone())
            self.audit(cur, actor, "publish", "query", name, before, after)
            return after
        return self.run(q, write=True)

    def delete_query(self, actor: str, name: str) -> bool:
        def q(cur):
            cur.execute(f"SELECT {self.Q_COLS} FROM qag_queries WHERE name = ?", (name,))
            r = cur.fetchone()
            if not r:
                return False
            cur.execute("DELETE FROM qag_query_versions WHERE query_name = ?", (name,))
            cur.execute("DELETE FROM qag_queries WHERE name = ?", (name,))
            self.audit(cur, actor, "delete", "query", name, self._q_row(r), None)
            return True
        return self.run(q, write=True)

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
        return self.run(q, write=True), secret

    def update_key(self, actor: str, name: str, grants: dict | None, fields: dict) -> dict | None:
        def q(cur):
            cur.execute(f"SELECT {self.K_COLS} FROM qag_api_keys WHERE name = ?", (name,))
            r = cur.fetchone()
            if not r:
                return None
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

    def rotate_key(self, actor: str, name: str, grace_minutes: float) -> tuple[dict, str] | None:
        secret = new_key_secret()
        now = timeutil.now()

        def q(cur):
            cur.execute(f"SELECT {self.K_COLS} FROM qag_api_keys WHERE name = ?", (name,))
            r = cur.fetchone()
            if not r:
                return None
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
        out = self.run(q, write=True)
        return (out, secret) if out else None

    def delete_key(self, actor: str, name: str) -> dict | None:
        def q(cur):
            cur.execute(f"SELECT {self.K_COLS} FROM qag_api_keys WHERE name = ?", (name,))
            r = cur.fetchone()
            if not r:
                return None
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
        return self.run(q, write=True)

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


class _Cursor:
    """A cursor that translates `?` markers and counts statements."""
    __slots__ = ("_store", "_cur")

    def __init__(self, store: Store, cur):
        self._store = store
        self._cur = cur

    def execute(self, sql: str, params: Iterable = ()):
        self._store.statements += 1
        obs = self._store.observer
        if obs is not None:
            obs.store_statement()
        try:
            return self._cur.execute(self._store._sql(sql), tuple(params))
        except sqlite3.IntegrityError:
            raise Conflict() from None
        except Exception as exc:
            if psycopg2 is not None and isinstance(exc, psycopg2.errors.UniqueViolation):
                raise Conflict() from None
            raise

    def fetchone(self):
        return self._cur.fetchone()

    def fetchall(self):
        return self._cur.fetchall()

    @property
    def rowcount(self):
        return self._cur.rowcount


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
                "allowed_ips", "rate_limit", "quota")


def public_key(row: dict) -> dict:
    g = row["grants"]
    out = {"name": row["name"], "prefix": row["prefix"], "active": row["active"], "expires_at": row["expires_at"],
           "description": row.get("description", "")}
    for f in GRANT_FIELDS:
        out[f] = g.get(f)
    out.update(created_at=row["created_at"], updated_at=row["updated_at"], rotated_at=row.get("rotated_at"),
               previous_secret_valid_until=row.get("prev_valid_until"))
    return out
