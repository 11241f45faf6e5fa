"""Issue 12, read as the servers read it, on real PostgreSQL and MariaDB (databases qag_govparse_*): a `:p`
PostgreSQL or MariaDB sees inside a literal or a comment is never bound (class 1), and a literal % works
with and without parameters through the connectors' own execute (class 9)."""

from __future__ import annotations

import pytest

from qag import config, connectors, params as P
from tests.conftest import mysql_exec, pg_exec, pg_fresh_db

CFG = config.load({"QAG_QUERY_TIMEOUT": "5", "QAG_CONNECT_TIMEOUT": "2"})
DB = "qag_govparse_drv"


@pytest.fixture(scope="module")
def pg():
    dsn = pg_fresh_db(DB)
    pg_exec(dsn, "CREATE TABLE t (id int PRIMARY KEY, name text)")
    pg_exec(dsn, "INSERT INTO t VALUES (1, 'Ada'), (2, 'Bob'), (3, 'A%%s')")  # pg_exec formats
    row = {"name": "pg", "db": "postgres", "host": "127.0.0.1", "port": 5432, "user": "postgres",
           "database": DB, "options": {}}
    c = connectors.make(row, None, CFG)
    yield c
    c.close()


@pytest.fixture(scope="module")
def my():
    mysql_exec(f"DROP DATABASE IF EXISTS {DB}")
    mysql_exec(f"CREATE DATABASE {DB}")
    mysql_exec(f"CREATE TABLE {DB}.t (id INT PRIMARY KEY, name VARCHAR(20))")
    mysql_exec(f"INSERT INTO {DB}.t VALUES (1, 'Ada'), (2, 'Bob'), (3, 'A%s')")
    row = {"name": "my", "db": "mysql", "host": "127.0.0.1", "port": 3306, "user": "root", "database": DB,
           "options": {}}
    c = connectors.make(row, "", CFG)
    yield c
    c.close()
    mysql_exec(f"DROP DATABASE IF EXISTS {DB}")


def run(c, sql, dialect, **values):
    driver, order = P.compile_sql(sql, dialect)
    return c.run(driver, tuple(values[n] for n in order), write=False, timeout=None, max_rows=None)[1]


@pytest.mark.parametrize("sql,want", [
    ("SELECT 7 % 2 AS m, count(*) AS n FROM t WHERE name LIKE 'A%'", [(1, 2)]),          # no parameters
    ("SELECT 7 % 2 AS m, count(*) AS n FROM t WHERE name LIKE 'A%' AND id > :i", [(1, 2)]),
])
def test_pg_literal_percent(pg, sql, want):
    assert run(pg, sql, "postgres", i=0) == want


@pytest.mark.parametrize("sql,want", [
    ("SELECT 7 % 2 AS m, count(*) AS n FROM t WHERE name LIKE 'A%'", [(1, 2)]),
    ("SELECT 7 % 2 AS m, count(*) AS n FROM t WHERE name LIKE 'A%' AND id > :i", [(1, 2)]),
    ("SELECT id FROM t WHERE name = 'A%s' AND id > :i", [(3,)]),    # a %s in a literal is not a placeholder
    ("SELECT id FROM t /* %s */ WHERE name LIKE '%s' AND id > :i", [(3,)]),
])
def test_mysql_literal_percent(my, sql, want):
    assert run(my, sql, "mysql", i=0) == want


def test_pg_marker_inside_e_string_and_nested_comment_is_not_bound(pg):
    # PostgreSQL reads both :p as text; a caller's value never reaches the statement.
    sql = "SELECT E'it\\'s :p' AS a /* a /* b */ :p */, :q AS b"
    assert [m[2] for m in P.scan_markers(sql, "postgres")] == ["q"]
    assert run(pg, sql, "postgres", q="x') --") == [("it's :p", "x') --")]
    native, names = P.compile_native(sql, "postgres")
    assert names == ("q",) and "$1" in native and ":p" in native


def test_mysql_marker_inside_literal_and_comments_is_not_bound(my):
    sql = "SELECT 'a '':p' AS a, \"b:p\" AS b # :p\n, :q AS c -- :p\n, 5--:r AS d"
    assert [m[2] for m in P.scan_markers(sql, "mysql")] == ["q", "r"]
    assert run(my, sql, "mysql", q="x' -- ", r=1) == [("a ':p", "b:p", "x' -- ", 6)]
