"""Issue 12, read as the servers read it, on real PostgreSQL and MariaDB (databases qag_govparse_*): a `:p`
PostgreSQL or MariaDB sees inside a literal or a comment is never bound (class 1), and a literal % works
with and without parameters through the connectors' own execute (class 9)."""

from __future__ import annotations

import pytest

from qag import config, connectors
from qag import params as P
from qag.governance import GovernanceError, apply_transforms, plan_governance
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


# ---- governance on what the servers really run ----------------------------------------------------------
KEY = b"govparse-key"
GOV_DB = "qag_govparse_gov"


@pytest.fixture(scope="module")
def pgc():
    import psycopg2

    dsn = pg_fresh_db(GOV_DB)
    pg_exec(dsn, "CREATE TABLE customers (id int PRIMARY KEY, name text, email text);"
                 "INSERT INTO customers VALUES (1, 'Ada', 'ada@example.com'), (2, 'Bob', 'bob@example.org')")
    c = psycopg2.connect(dsn)
    c.autocommit = True
    yield c
    c.close()


def pg_columns(conn):
    def columns_of(schema, table):
        with conn.cursor() as cur:
            cur.execute("SELECT column_name FROM information_schema.columns WHERE table_schema = %s AND "
                        "table_name = %s ORDER BY ordinal_position", (schema, table))
            return [r[0] for r in cur.fetchall()] or None
    return columns_of


def governed(sql, dialect, columns_of, schema, mask=(("customers.email", "mask"),), allowed=None):
    return plan_governance(sql=sql, dialect=dialect, default_schema=schema, allowed_tables=allowed,
                           mask_rules=[{"column": c, "action": a} for c, a in mask], server_allows_writes=False,
                           key_allows_writes=False, allowed_write_ops=None, allow_unsafe=False, columns_of=columns_of)


def pg_rows(conn, sql):
    with conn.cursor() as cur:
        cur.execute(sql)
        return [d[0] for d in cur.description], cur.fetchall()


def test_pg_unicode_escaped_unsafe_function_is_refused(pgc):
    sql = "SELECT U&\"pg\\005fread\\005ffile\"('PG_VERSION')"
    assert pg_rows(pgc, sql)[1][0][0].strip().isdigit()          # the server runs it: it reads a file
    with pytest.raises(GovernanceError) as ei:
        governed(sql, "postgres", pg_columns(pgc), "public")
    assert ei.value.code == "unsafe_function" and "pg_read_file" in ei.value.message


def test_pg_unicode_escaped_column_is_masked(pgc):
    sql = 'SELECT id, U&"em\\0061il" AS e FROM customers ORDER BY id'
    plan = governed(sql, "postgres", pg_columns(pgc), "public")
    cols, rows = pg_rows(pgc, sql)
    assert rows[0][1] == "ada@example.com"
    assert apply_transforms(plan.transforms, cols, rows, KEY, names=plan.output_names)[1] == \
        [(1, "a***@example.com"), (2, "b***@example.org")]


@pytest.mark.parametrize("sql", [
    'SELECT c.email FROM (SELECT \'x\' AS email) "C", customers c ORDER BY c.id',
    'SELECT (SELECT email FROM (SELECT 1 AS "EMAIL") x) FROM customers ORDER BY id',
    'SELECT "EMAIL" FROM (SELECT email AS "EMAIL", name AS email FROM customers) s ORDER BY 1',
])
def test_pg_quoted_names_do_not_capture_the_masked_column(pgc, sql):
    plan = governed(sql, "postgres", pg_columns(pgc), "public")
    cols, rows = pg_rows(pgc, sql)
    assert {r[0] for r in rows} == {"ada@example.com", "bob@example.org"}        # the server returns it
    out = apply_transforms(plan.transforms, cols, rows, KEY, names=plan.output_names)[1]
    assert out == [("a***@example.com",), ("b***@example.org",)]


def test_pg_unnamed_expression_in_a_derived_table_answers(pgc):
    sql = "SELECT id FROM (SELECT lower(email), id FROM customers) s ORDER BY id"
    plan = governed(sql, "postgres", pg_columns(pgc), "public")
    assert not any(plan.transforms or ()) and pg_rows(pgc, sql)[1] == [(1,), (2,)]   # nothing masked (shape pinned)


def test_pg_whole_row_forms_are_refused(pgc):
    for sql in ("SELECT c.row_to_json FROM customers c", "SELECT row_to_json(c) FROM customers c",
                "SELECT c FROM customers c", "SELECT to_jsonb(c) FROM customers c",
                "SELECT json_agg(c) FROM customers c"):
        assert "ada@example.com" in str(pg_rows(pgc, sql)[1])
        with pytest.raises(GovernanceError) as ei:
            governed(sql, "postgres", pg_columns(pgc), "public")
        assert ei.value.code == "mask_unresolvable", sql


@pytest.fixture(scope="module")
def myc():
    import mysql.connector

    mysql_exec(f"DROP DATABASE IF EXISTS {GOV_DB}")
    mysql_exec(f"CREATE DATABASE {GOV_DB}")
    mysql_exec(f"CREATE TABLE {GOV_DB}.customers (id INT PRIMARY KEY, name VARCHAR(20), email VARCHAR(40))")
    mysql_exec(f"INSERT INTO {GOV_DB}.customers VALUES (1, 'Ada', 'ada@example.com'), (2, 'Bob', 'bob@example.org')")
    c = mysql.connector.connect(host="127.0.0.1", port=3306, user="root", database=GOV_DB, autocommit=True)
    yield c
    c.close()
    mysql_exec(f"DROP DATABASE IF EXISTS {GOV_DB}")


def test_mariadb_table_alias_case_does_not_capture(myc):
    cur = myc.cursor()
    cur.execute("SELECT @@lower_case_table_names")
    lctn = int(cur.fetchone()[0])
    sql = "SELECT c.email FROM (SELECT 'x' AS email) C JOIN customers c ON 1 = 1 ORDER BY c.id"
    cols = {("qag_govparse_gov", "customers"): ["id", "name", "email"]}
    plan = governed(sql, "mysql", lambda s, t: cols.get((s, t)), GOV_DB)
    assert plan.transforms == ("mask",)
    if lctn == 0:     # aliases are case-sensitive: c is the table and its emails come back
        cur.execute(sql)
        rows = cur.fetchall()
        assert apply_transforms(plan.transforms, ["email"], rows, KEY)[1] == [("a***@example.com",),
                                                                              ("b***@example.org",)]
