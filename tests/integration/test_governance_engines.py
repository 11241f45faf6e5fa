"""SELECT * expansion and masking checked against real SQLite and ClickHouse (chDB) engines: the plan's
output columns must be the engine's, position for position, or masks would land on the wrong column."""

from __future__ import annotations

import sqlite3

import pytest

from qag.governance import apply_transforms, plan_governance

KEY = b"engine-key"
RULES = [{"column": "*.email", "action": "mask"}, {"column": "*.card", "action": "drop"}]


def gov(sql, dialect, schema, columns_of):
    return plan_governance(sql=sql, dialect=dialect, default_schema=schema, allowed_tables=None, mask_rules=RULES,
                           server_allows_writes=False, key_allows_writes=False, allowed_write_ops=None,
                           allow_unsafe=False, columns_of=columns_of)


def want(names, sql=""):
    if "UNION" in sql:
        return [None, "drop", "drop", None]   # a.email/b.card and a.card/b.email: the strictest wins
    return [("mask" if n.split(".")[-1] == "email" else "drop" if n.split(".")[-1] == "card" else None)
            for n in names]


QUERIES = [
    "SELECT * FROM a",
    "SELECT * FROM a JOIN b ON a.id = b.id",
    "SELECT * FROM a JOIN b USING (id)",
    "SELECT * FROM a JOIN b USING (email, id)",
    "SELECT * FROM b JOIN a USING (id)",
    "SELECT b.*, a.id FROM a JOIN b ON a.id = b.id",
    "SELECT * FROM (SELECT id, email FROM b) x JOIN a ON a.id = x.id",
    "WITH w AS (SELECT * FROM b) SELECT * FROM w",
    "SELECT * FROM a UNION ALL SELECT id, card, email, note FROM b",
]


def test_sqlite():
    c = sqlite3.connect(":memory:")
    c.executescript("CREATE TABLE a (id, email, card, x); CREATE TABLE b (id, card, email, note);"
                    "INSERT INTO a VALUES (1, 'ann@x.example', '4111', 'ax');"
                    "INSERT INTO b VALUES (1, '5500', 'ann@y.example', 'bn');")

    def columns_of(schema, table):
        rows = c.execute(f"PRAGMA {schema}.table_info({table})").fetchall()
        return [r[1] for r in rows] or None

    for sql in QUERIES + ["SELECT * FROM a NATURAL JOIN b", "SELECT * FROM b NATURAL JOIN a"]:
        plan = gov(sql, "sqlite", "main", columns_of)
        cur = c.execute(sql)
        names = [d[0] for d in cur.description]
        assert list(plan.output_names) == names, sql
        assert list(plan.transforms) == want(names, sql), sql
    sql = "SELECT * FROM a JOIN b USING (id)"
    cur = c.execute(sql)
    plan = gov(sql, "sqlite", "main", columns_of)
    cols, rows = apply_transforms(plan.transforms, [d[0] for d in cur.description], cur.fetchall(), KEY,
                                  names=plan.output_names)
    assert cols == ["id", "email", "x", "email", "note"]
    assert rows == [(1, "a***@x.example", "ax", "a***@y.example", "bn")]


def test_clickhouse_chdb():
    session = pytest.importorskip("chdb.session")
    s = session.Session()
    try:
        s.query("CREATE DATABASE IF NOT EXISTS qag_gov_ch")
        s.query("DROP TABLE IF EXISTS qag_gov_ch.a")
        s.query("DROP TABLE IF EXISTS qag_gov_ch.b")
        s.query("CREATE TABLE qag_gov_ch.a (id UInt32, email String, card String, x String) ENGINE = Memory")
        s.query("CREATE TABLE qag_gov_ch.b (id UInt32, card String, email String, note String) ENGINE = Memory")
        s.query("INSERT INTO qag_gov_ch.a VALUES (1, 'ann@x.example', '4111', 'ax')")
        s.query("INSERT INTO qag_gov_ch.b VALUES (1, '5500', 'ann@y.example', 'bn')")

        def columns_of(schema, table):
            out = s.query(f"SELECT name FROM system.columns WHERE database = '{schema}' AND table = '{table}' "
                          "ORDER BY position", "TabSeparated").bytes().decode().split("\n")
            return [x for x in out if x] or None

        for sql in QUERIES + ["SELECT * EXCEPT (card) FROM a", "SELECT * REPLACE (upper(x) AS x) FROM a"]:
            plan = gov(sql, "clickhouse", "qag_gov_ch", columns_of)
            out = s.query(sql.replace(" FROM a", " FROM qag_gov_ch.a").replace(" FROM b", " FROM qag_gov_ch.b")
                          .replace(" JOIN a", " JOIN qag_gov_ch.a").replace(" JOIN b", " JOIN qag_gov_ch.b")
                          + " LIMIT 0", "TSVWithNames").bytes().decode()
            names = out.split("\n")[0].split("\t")
            assert len(plan.output_names) == len(names), (sql, plan.output_names, names)
            assert [n.split(".")[-1] for n in plan.output_names] == [n.split(".")[-1] for n in names], sql
            assert list(plan.transforms) == want(names, sql), sql
    finally:
        s.query("DROP DATABASE IF EXISTS qag_gov_ch")
        s.close()
