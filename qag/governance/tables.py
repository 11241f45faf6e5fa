"""Table names: resolve a statement's references to (schema, table) and check them against an allow-list.

Resolution: PostgreSQL bare names go to the connection's schema, except pg_* names, which PostgreSQL finds
in pg_catalog first; MySQL/MariaDB and ClickHouse bare names go to the connection's database; SQLite's to main.
"""

from __future__ import annotations

import re

# PostgreSQL folds unquoted names to lower case, ASCII letters only (analysis.normalize_identifier too)
ASCII_LOWER = str.maketrans("ABCDEFGHIJKLMNOPQRSTUVWXYZ", "abcdefghijklmnopqrstuvwxyz")

_PART = re.compile(r'"((?:[^"]|"")*)"|`((?:[^`]|``)*)`|\[([^\]]*)\]|([^."`\[]+)')


def split_name(text: str, dialect: str) -> list[str] | None:
    """Split 'a.b.c' (parts optionally quoted) into normalized parts; None if it is not a dotted name."""
    text = text.strip()
    parts: list[str] = []
    pos = 0
    while pos <= len(text):
        m = _PART.match(text, pos)
        if not m:
            return None
        if m.group(1) is not None:
            part, quoted = m.group(1).replace('""', '"'), True
        elif m.group(2) is not None:
            part, quoted = m.group(2).replace("``", "`"), True
        elif m.group(3) is not None:
            part, quoted = m.group(3), True
        else:
            part, quoted = m.group(4).strip(), False
            if not part:
                return None
        parts.append(normalize_text(part, quoted, dialect))
        pos = m.end()
        if pos == len(text):
            break
        if text[pos] != ".":
            return None
        pos += 1
    return parts or None


def normalize_text(part: str, quoted: bool, dialect: str) -> str:
    if dialect == "clickhouse" or (dialect == "postgres" and quoted):
        return part
    if dialect == "postgres":
        return part.translate(ASCII_LOWER)
    return part.lower()


def default_schema_for(dialect: str, default_schema: str | None) -> str:
    if dialect == "sqlite":
        parts = split_name(default_schema, dialect) if default_schema else None
        return parts[-1] if parts else "main"
    if not default_schema:
        if dialect == "postgres":
            return "public"
        return ""
    text = default_schema
    if dialect == "postgres":
        # A search_path: the first schema that is not "$user" (or implicit catalogs) is where bare names go.
        entries = [e.strip() for e in default_schema.split(",") if e.strip()]
        entries = [e for e in entries if e.strip('"') not in ("$user", "pg_catalog", "pg_temp")] or ["public"]
        text = entries[0]
    parts = split_name(text, dialect)
    return parts[-1] if parts else text


def resolve(refs, dialect: str, default_schema: str) -> frozenset[tuple[str, str]]:
    out = set()
    for db, name in refs:
        if db is None:
            if dialect == "postgres" and name.startswith("pg_"):
                db = "pg_catalog"   # pg_catalog is searched before the search_path unless listed in it
            else:
                db = default_schema
        out.add((db, name))
    return frozenset(out)


def parse_allowed(entries, dialect: str, default_schema: str) -> list[tuple[str, str]]:
    """Allow-list entries: 'schema.table' or a bare 'table' (the connection's default schema); a part may
    be '*' (e.g. 'crm.*'). Three-part PostgreSQL names (db.schema.table) keep schema.table."""
    allowed = []
    for entry in entries:
        parts = split_name(str(entry), dialect)
        if not parts:
            continue
        if len(parts) == 1:
            allowed.append((default_schema, parts[0]))
        else:
            allowed.append((parts[-2], parts[-1]))
    return allowed


def forbidden_tables(tables, allowed: list[tuple[str, str]]) -> list[tuple[str, str]]:
    exact = set(allowed)
    out = []
    for t in tables:
        if t in exact:
            continue
        if any((a[0] == "*" or a[0] == t[0]) and (a[1] == "*" or a[1] == t[1]) for a in allowed):
            continue
        out.append(t)
    return sorted(out)


def table_text(t: tuple[str, str]) -> str:
    return f"{t[0]}.{t[1]}"
