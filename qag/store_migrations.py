"""The metadata store's schema (qag/store.py): one migration per version, each statement written for the
dialects it runs on. A statement is either one text that both SQLite and PostgreSQL run as written, or a
{dialect: text} per dialect (a dialect left out does not run it). Nothing is rewritten at run time: what is
here is what each database runs.

The version applied last is kept in qag_schema_version; a store whose version is above LATEST was migrated by
a newer qag, and this one refuses to start on it (qag.errors.SchemaTooNew).
"""
from __future__ import annotations

from typing import NamedTuple

DIALECTS = ("sqlite", "postgres")

Statement = str | dict


class Migration(NamedTuple):
    version: int
    description: str
    statements: tuple[Statement, ...]


def render(migration: Migration, dialect: str) -> list[str]:
    """The statements `dialect` runs for `migration`, in order."""
    if dialect not in DIALECTS:
        raise ValueError(f"unknown metadata store dialect {dialect!r}")
    out = []
    for stmt in migration.statements:
        if isinstance(stmt, dict):
            stmt = stmt.get(dialect)
            if stmt is None:
                continue
        out.append(stmt)
    return out


VERSION_TABLE = ("CREATE TABLE IF NOT EXISTS qag_schema_version (version INTEGER PRIMARY KEY, "
                 "description TEXT NOT NULL, applied_at TEXT NOT NULL)")

MIGRATIONS: tuple[Migration, ...] = (
    Migration(1, "initial schema", (
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
        # The audit id: SQLite's INTEGER PRIMARY KEY is the rowid, assigned at insert; PostgreSQL's is a sequence.
        {"sqlite": """CREATE TABLE IF NOT EXISTS qag_audit (
            id INTEGER PRIMARY KEY, at TEXT NOT NULL, actor TEXT NOT NULL, action TEXT NOT NULL,
            entity TEXT NOT NULL, name TEXT NOT NULL, before TEXT, after TEXT)""",
         "postgres": """CREATE TABLE IF NOT EXISTS qag_audit (
            id BIGSERIAL PRIMARY KEY, at TEXT NOT NULL, actor TEXT NOT NULL, action TEXT NOT NULL,
            entity TEXT NOT NULL, name TEXT NOT NULL, before TEXT, after TEXT)"""},
        """CREATE TABLE IF NOT EXISTS qag_kv (k TEXT PRIMARY KEY, v TEXT NOT NULL)""",
    )),
    # Audit ids are assigned at insert, so on PostgreSQL a smaller id may commit after a larger one: a watcher
    # that remembers "applied up to id N" could skip a change for good. Every change now also takes the next
    # number of one counter row, whose row lock it holds to its commit: numbers commit in order, with no gaps.
    Migration(2, "change sequence numbers, committed in order", (
        "CREATE TABLE IF NOT EXISTS qag_change_seq (id INTEGER PRIMARY KEY, n BIGINT NOT NULL)",
        "INSERT INTO qag_change_seq (id, n) SELECT 1, COALESCE(MAX(id), 0) FROM qag_audit",
        "ALTER TABLE qag_audit ADD COLUMN seq BIGINT",
        "UPDATE qag_audit SET seq = id",
        "CREATE UNIQUE INDEX IF NOT EXISTS qag_audit_seq ON qag_audit (seq)",
    )),
    # A writer that does not number its change itself (a host still on the previous version during an upgrade,
    # a script inserting its audit row) gets the next number from the store, so no watcher can miss it.
    Migration(3, "audit rows without a sequence number get the next one", (
        {"postgres": """CREATE OR REPLACE FUNCTION qag_audit_number() RETURNS trigger LANGUAGE plpgsql AS $$
            BEGIN
                IF NEW.seq IS NULL THEN
                    UPDATE qag_change_seq SET n = n + 1 WHERE id = 1 RETURNING n INTO NEW.seq;
                END IF;
                RETURN NEW;
            END $$"""},
        {"postgres": "CREATE TRIGGER qag_audit_number BEFORE INSERT ON qag_audit FOR EACH ROW "
                     "EXECUTE FUNCTION qag_audit_number()"},
        {"sqlite": """CREATE TRIGGER IF NOT EXISTS qag_audit_number AFTER INSERT ON qag_audit
            WHEN NEW.seq IS NULL
            BEGIN
                UPDATE qag_change_seq SET n = n + 1 WHERE id = 1;
                UPDATE qag_audit SET seq = (SELECT n FROM qag_change_seq WHERE id = 1) WHERE id = NEW.id;
            END"""},
    )),
)

LATEST = MIGRATIONS[-1].version
