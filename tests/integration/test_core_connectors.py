"""Connectors against the real databases: read-only sessions, the statement time limit, one round trip per
read, unreachable databases, a pool that recovers, values bound by the driver."""
from __future__ import annotations

import sqlite3
import time

import pytest

from qag import config, connectors
from qag import params as P
from qag.connectors import QueryFailed
from qag.errors import Timeout, Unreachable
from qag.http.errors import status_of
from tests.conftest import free_port, mysql_exec, pg_exec, pg_fresh_db

CFG = config.load({"QAG_QUERY_TIMEOUT": "1", "QAG_CONNECT_TIMEOUT": "2"})


@pytest.fixture(scope="module")
def pg():
    dsn = pg_fresh_db("qag_core_conn")
    pg_exec(dsn, "CREATE TABLE t (id int PRIMARY KEY, name text)")
    pg_exec(dsn, "INSERT INTO t VALUES (1, 'a'), (2, 'b''quote'), (3, 'c')")
    row = {"name": "pg", "db": "postgres", "host": "127.0.0.1", "port": 5432, "user": "postgres",
           "database": "qag_core_conn", "options": {}}
    c = connectors.make(row, None, CFG)
    yield c, dsn
    c.close()


def test_pg_read_is_one_round_trip_and_read_only(pg):
    c, dsn = pg
    sql, names = P.compile_sql("SELECT id, name FROM t WHERE id = :id", "postgres")
    c.run(sql, (1,), write=False, timeout=None, max_rows=None)  # open the session
    before = pg_exec(dsn, "SELECT xact_commit FROM pg_stat_database WHERE datname = current_database()")[0][0]
    for i in range(50):
        cols, rows, _ = c.run(sql, (1 + i % 3,), write=False, timeout=None, max_rows=None)
    time.sleep(0.6)  # pg_stat_database is flushed at most every 500 ms
    after = pg_exec(dsn, "SELECT xact_commit FROM pg_stat_database WHERE datname = current_database()")[0][0]
    assert cols == ["id", "name"]
    assert after - before <= 52  # 50 reads, one transaction each (+ the two probes)
    with pytest.raises(QueryFailed) as ei:
        c.run("DELETE FROM t", (), write=False, timeout=None, max_rows=None)
    assert "read-only" in ei.value.db_text
    assert pg_exec(dsn, "SELECT count(*) FROM t") == [(3,)]


def test_pg_values_are_bound_never_spliced(pg):
    c, dsn = pg
    sql, _ = P.compile_sql("SELECT id FROM t WHERE name = :n", "postgres")
    assert c.run(sql, ("b'quote",), write=False, timeout=None, max_rows=None)[1] == [(2,)]
    assert c.run(sql, ("x' OR '1'='1",), write=False, timeout=None, max_rows=None)[1] == []


def test_pg_timeout_cancels(pg):
    c, _ = pg
    t0 = time.monotonic()
    with pytest.raises(Timeout) as ei:
        c.run("SELECT pg_sleep(5)", (), write=False, timeout=None, max_rows=None)
    assert ei.value.code == "query_timeout" and status_of(ei.value) == 504 and time.monotonic() - t0 < 3
    assert c.run("SELECT 1", (), write=False, timeout=None, max_rows=None)[1] == [(1,)]


def test_pg_pool_recovers_after_sessions_are_killed(pg):
    c, dsn = pg
    c.run("SELECT 1", (), write=False, timeout=None, max_rows=None)
    pg_exec(dsn, "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE application_name = 'qag' "
                 "AND datname = 'qag_core_conn'")
    assert c.run("SELECT 2", (), write=False, timeout=None, max_rows=None)[1] == [(2,)]


def test_unreachable_fails_fast_without_password():
    row = {"name": "dead", "db": "postgres", "host": "127.0.0.1", "port": free_port(), "user": "u",
           "database": "d", "options": {}}
    c = connectors.make(row, "pw-secret", CFG)
    t0 = time.monotonic()
    with pytest.raises(Unreachable) as ei:
        c.run("SELECT 1", (), write=False, timeout=None, max_rows=None)
    assert status_of(ei.value) == 502 and ei.value.code == "connection_failed"
    assert "pw-secret" not in ei.value.message and time.monotonic() - t0 < 3


@pytest.fixture(scope="module")
def my():
    mysql_exec("DROP DATABASE IF EXISTS qag_core_conn")
    mysql_exec("CREATE DATABASE qag_core_conn")
    mysql_exec("CREATE TABLE qag_core_conn.t (id INT PRIMARY KEY, name VARCHAR(20))")
    mysql_exec("INSERT INTO qag_core_conn.t VALUES (1, 'a'), (2, 'b')")
    row = {"name": "my", "db": "mysql", "host": "127.0.0.1", "port": 3306, "user": "root", "database": "qag_core_conn",
           "options": {}}
    c = connectors.make(row, "", CFG)
    yield c
    c.close()


def test_mysql_read_only_session_and_binding(my):
    sql, _ = P.compile_sql("SELECT id, name FROM t WHERE name = :n OR name LIKE '%%z'", "mysql")
    assert my.run(sql, ("b",), write=False, timeout=None, max_rows=None)[1] == [(2, "b")]
    with pytest.raises(QueryFailed) as ei:
        my.run("DELETE FROM t", (), write=False, timeout=None, max_rows=None)
    assert "READ ONLY" in ei.value.db_text.upper()
    assert mysql_exec("SELECT count(*) FROM qag_core_conn.t") == [(2,)]


def test_mysql_write_session_commits(my):
    cols, rows, n = my.run("UPDATE t SET name = %s WHERE id = %s", ("aa", 1), write=True, timeout=None, max_rows=None)
    assert n == 1 and mysql_exec("SELECT name FROM qag_core_conn.t WHERE id = 1") == [("aa",)]


def test_mysql_timeout(my):
    t0 = time.monotonic()
    with pytest.raises(Timeout) as ei:
        my.run("SELECT SLEEP(5) FROM t", (), write=False, timeout=None, max_rows=None)
    assert ei.value.code == "query_timeout" and time.monotonic() - t0 < 4
    assert my.run("SELECT 1", (), write=False, timeout=None, max_rows=None)[1] == [(1,)]


def test_sqlite_read_only_and_deadline(tmp_path):
    path = str(tmp_path / "d.db")
    db = sqlite3.connect(path)
    db.execute("CREATE TABLE t (id INTEGER PRIMARY KEY)")
    db.executemany("INSERT INTO t VALUES (?)", [(i,) for i in range(1000)])
    db.commit()
    db.close()
    c = connectors.make({"name": "s", "db": "sqlite", "database": path, "options": {}}, None, CFG)
    with pytest.raises(QueryFailed) as ei:
        c.run("DELETE FROM t", (), write=False, timeout=None, max_rows=None)
    assert "readonly" in ei.value.db_text.replace(" ", "").lower()
    t0 = time.monotonic()
    with pytest.raises(Timeout) as ei:  # a cross join that runs for ever
        c.run("SELECT count(*) FROM t a, t b, t c, t d", (), write=False, timeout=0.3, max_rows=None)
    assert ei.value.code == "query_timeout" and time.monotonic() - t0 < 2
    assert c.run("SELECT count(*) FROM t", (), write=False, timeout=None, max_rows=None)[1] == [(1000,)]


def test_clickhouse_through_chdb(tmp_path):
    pytest.importorskip("chdb")
    import clickhouse_connect
    d = str(tmp_path / "ch")
    cl = clickhouse_connect.get_client(dsn=f"chdb://{d}")
    cl.command("CREATE TABLE default.t (id UInt32, name String) ENGINE = MergeTree ORDER BY id")
    cl.command("INSERT INTO default.t VALUES (1, 'a'), (2, 'b''q')")
    cl.close()
    c = connectors.make({"name": "ch", "db": "clickhouse", "host": f"chdb:{d}", "database": "default",
                         "options": {}}, None, CFG)
    sql, _ = P.compile_sql("SELECT id FROM t WHERE name = :n", "clickhouse")
    assert c.run(sql, ("b'q",), write=False, timeout=None, max_rows=None)[1] == [(2,)]
    c.close()
