"""The per-dialect function allow-lists (qag/governance/functions/*.txt, issue 12 class 3) against the running
servers' own catalogues: every entry is a built-in the server knows, and every [syntax] example is read by the
server as the construct it names. A typo or an entry a server version dropped fails here, not in production."""
from __future__ import annotations

import sqlite3

import pytest

from qag.governance.functions import allow_list
from tests.conftest import MYSQL, PG_ADMIN_DSN, pg_exec


def test_postgresql_every_entry_is_in_pg_catalog():
    al = allow_list("postgres")
    have = {n for (n,) in pg_exec(PG_ADMIN_DSN, "SELECT DISTINCT proname FROM pg_proc WHERE pronamespace = "
                                                "'pg_catalog'::regnamespace")}
    missing = [n for n in al.functions if n not in have]
    assert not missing, f"not functions of this server's pg_catalog: {missing}"
    for name, example in al.syntax.items():
        assert name not in have, f"{name} is a pg_proc function: list it above [syntax]"
        pg_exec(PG_ADMIN_DSN, f"SELECT {example}")   # raises if the server does not read it


def _mysql_prepare_error(cur, sql: str):
    import mysql.connector
    try:
        cur.execute("PREPARE qag_probe FROM %s", (sql,))
        cur.execute("DEALLOCATE PREPARE qag_probe")
        return None
    except mysql.connector.Error as exc:
        return exc.errno, exc.msg


def test_mariadb_every_entry_is_a_builtin():
    """MariaDB has no catalogue of built-ins: preparing `SELECT f()` in an empty database says "FUNCTION db.f does
    not exist" (1305, or 1630 with a hint) for a name that is no built-in, and something else (success, a wrong
    argument count 1582, a syntax error 1064 for a keyword-like built-in) for one that is."""
    import mysql.connector
    db = "qag_govpolicy_catalogue"
    conn = mysql.connector.connect(**MYSQL, autocommit=True)
    try:
        cur = conn.cursor()
        cur.execute(f"DROP DATABASE IF EXISTS {db}")
        cur.execute(f"CREATE DATABASE {db}")
        cur.execute(f"USE {db}")
        assert _mysql_prepare_error(cur, "SELECT qag_no_such_function()")[0] in (1305, 1630)   # the probe works
        al = allow_list("mysql")
        missing = []
        for name in al.functions:
            err = _mysql_prepare_error(cur, f"SELECT {name}()")
            if err is not None and err[0] in (1305, 1630):
                missing.append(name)
        assert not missing, f"not built-ins of this server: {missing}"
        for name, example in al.syntax.items():
            err = _mysql_prepare_error(cur, example)
            assert err is None or err[0] not in (1064, 1305, 1630), (name, example, err)
    finally:
        try:
            conn.cursor().execute(f"DROP DATABASE IF EXISTS {db}")
        finally:
            conn.close()


def test_sqlite_every_entry_is_in_pragma_function_list():
    al = allow_list("sqlite")
    db = sqlite3.connect(":memory:")
    have = {n for (n,) in db.execute("SELECT name FROM pragma_function_list")}
    missing = [n for n in al.functions if n not in have]
    assert not missing, f"not functions of this sqlite3 module ({sqlite3.sqlite_version}): {missing}"
    for name, example in al.syntax.items():
        assert name not in have, f"{name} is in pragma_function_list: list it above [syntax]"
        db.execute(example).fetchall()


def test_clickhouse_every_entry_is_in_system_functions():
    chdb = pytest.importorskip("chdb")
    al = allow_list("clickhouse")
    have = set(str(chdb.query("SELECT name FROM system.functions", "TSV")).splitlines())
    missing = [n for n in al.functions if n not in have]
    assert not missing, f"not functions of this ClickHouse (chDB {chdb.__version__}): {missing}"
    user_defined = str(chdb.query("SELECT name FROM system.functions WHERE origin != 'System' AND name IN "
                                  f"({', '.join(repr(n) for n in al.functions)})", "TSV")).split()
    assert not user_defined, user_defined
    for example in al.syntax.values():
        chdb.query(example, "TSV")
