"""Pooled sessions on the real servers carry nothing from one caller to the next (connectors S5), reads run in
transactions that cannot become read-write (S2), a statement error is 500 whatever its SQLSTATE class while a
lost database is 502 (S7), and a connection's role is reported privileged or not (S8)."""
from __future__ import annotations

import pytest

from qag import config, connectors
from qag.connectors import QueryFailed
from qag.errors import Timeout, Unreachable
from qag.http.errors import status_of
from tests.conftest import free_port, mysql_exec, pg_exec, pg_fresh_db

CFG = config.load({"QAG_QUERY_TIMEOUT": "2", "QAG_CONNECT_TIMEOUT": "2", "QAG_POOL_SIZE": "1"})


def one(c, sql, args=(), **kw):
    kw.setdefault("state_free", connectors.state_free(sql.replace("%s", "NULL"), c.dialect))
    return c.run(sql, args, write=False, timeout=kw.pop("timeout", None), max_rows=None, **kw)[1]


@pytest.fixture(scope="module")
def pg():
    dsn = pg_fresh_db("qag_dbsess")
    pg_exec(dsn, "CREATE TABLE t (id int PRIMARY KEY, email text)")
    pg_exec(dsn, "INSERT INTO t VALUES (1, 'ada@example.com')")
    pg_exec(dsn, "CREATE ROLE qag_dbsess_plain LOGIN") if not pg_exec(
        dsn, "SELECT 1 FROM pg_roles WHERE rolname = 'qag_dbsess_plain'") else None
    pg_exec(dsn, "GRANT SELECT ON t TO qag_dbsess_plain")
    row = {"name": "pg", "db": "postgres", "host": "127.0.0.1", "port": 5432, "user": "postgres",
           "database": "qag_dbsess", "options": {}}
    c = connectors.make(row, None, CFG)  # pool of one: every call gets the previous caller's session
    yield c, dsn
    c.close()


@pytest.mark.parametrize("change, probe, clean", [
    ("SELECT set_config('search_path', 'evil', false)", "SELECT current_setting('search_path')",
     [('"$user", public',)]),
    ("SELECT set_config('statement_timeout', '0', false)", "SELECT current_setting('statement_timeout')", [("2s",)]),
    ("SELECT set_config('default_transaction_read_only', 'off', false)",
     "SELECT current_setting('default_transaction_read_only')", [("on",)]),
    ("SELECT set_config('myapp.x', 'leak', false)", "SELECT current_setting('myapp.x', true)", [("",)]),
    ("SELECT set_config('role', 'qag_dbsess_plain', false)", "SELECT current_user", [("postgres",)]),
])
def test_pg_settings_do_not_reach_the_next_caller(pg, change, probe, clean):
    c, _ = pg
    one(c, change)
    assert one(c, probe) == clean
    assert c.opened >= 1 and c.idle_count() == 1


def test_pg_locks_and_listen_do_not_outlive_the_call(pg):
    c, dsn = pg
    one(c, "SELECT pg_advisory_lock(4242)")
    assert pg_exec(dsn, "SELECT pg_try_advisory_lock(4242)") == [(True,)]  # another session gets it at once
    one(c, "SELECT count(*) FROM pg_prepared_statements")
    assert one(c, "SELECT count(*) FROM pg_listening_channels()") == [(0,)]


def test_pg_misjudged_state_free_still_cannot_carry_read_write(pg):
    """Even a statement wrongly claimed state-free cannot leave a read-write session behind: the reported
    default_transaction_read_only (ParameterStatus) discards it, and each read is its own READ ONLY transaction."""
    c, dsn = pg
    opened = c.opened
    c.run("SELECT set_config('default_transaction_read_only', 'off', false)", (), write=False, timeout=None,
          max_rows=None, state_free=True)
    with pytest.raises(QueryFailed) as ei:
        c.run("WITH d AS (DELETE FROM t RETURNING id) SELECT count(*) FROM d", (), write=False, timeout=None,
              max_rows=None, state_free=True)
    assert "read-only" in ei.value.db_text and c.opened == opened + 1
    assert pg_exec(dsn, "SELECT count(*) FROM t") == [(1,)]


def test_pg_a_read_cannot_become_read_write_inside_its_transaction(pg):
    c, dsn = pg
    with pytest.raises(QueryFailed) as ei:
        one(c, "SELECT set_config('transaction_read_only', 'off', true), (SELECT count(*) FROM t)")
    assert "read-write" in ei.value.db_text or "before any query" in ei.value.db_text
    assert one(c, "SELECT current_setting('transaction_read_only')") == [("on",)]


def test_pg_statement_error_of_an_operational_class_is_query_failed(pg):
    """58P01 (could not stat file) is an OperationalError to psycopg2, but the session is fine: 500, not 502."""
    c, _ = pg
    with pytest.raises(QueryFailed) as ei:
        one(c, "SELECT pg_stat_file('ada@example.com')")
    assert "ada@example.com" in ei.value.db_text  # for administrators; qag/http/errors.py hides it from keys
    assert one(c, "SELECT 1") == [(1,)]


def test_pg_a_write_is_one_message_and_its_own_transaction(pg):
    """S2 for writes: one simple-query message in autocommit, one implicit transaction: the statement's count is
    kept, a commit-time failure keeps nothing, a statement that refuses a transaction block is still refused, a
    `BEGIN` cannot leave a transaction open for the next caller, and the next write finds the session clean."""
    c, dsn = pg
    pg_exec(dsn, "CREATE TABLE IF NOT EXISTS w_parent (id int PRIMARY KEY)")
    pg_exec(dsn, "CREATE TABLE IF NOT EXISTS w_child (id int PRIMARY KEY, p int REFERENCES w_parent "
                 "DEFERRABLE INITIALLY DEFERRED)")
    pg_exec(dsn, "TRUNCATE w_child, w_parent")

    def write(sql, args=()):
        return c.run(sql, args, write=True, timeout=None, max_rows=None)

    assert write("INSERT INTO w_parent SELECT g FROM generate_series(1, %s) g", (3,))[2] == 3
    assert write("UPDATE w_parent SET id = id + 10 WHERE id >= %s RETURNING id", (2,))[1:] == ([(12,), (13,)], 2)
    with pytest.raises(QueryFailed) as ei:  # the deferred check fails at the implicit commit: nothing kept
        write("INSERT INTO w_child VALUES (1, 99)")
    assert "foreign key" in ei.value.db_text
    assert pg_exec(dsn, "SELECT count(*) FROM w_child") == [(0,)]
    with pytest.raises(QueryFailed) as ei:  # as under BEGIN: never outside a transaction block
        write("CREATE INDEX CONCURRENTLY w_parent_ix ON w_parent (id)")
    assert "transaction block" in ei.value.db_text
    assert pg_exec(dsn, "SELECT count(*) FROM pg_indexes WHERE indexname = 'w_parent_ix'") == [(0,)]
    write("BEGIN")  # left open by the statement: rolled back and reset before the session serves again
    assert write("INSERT INTO w_child VALUES (1, 1)")[2] == 1
    assert pg_exec(dsn, "SELECT count(*) FROM w_child") == [(1,)]
    assert pg_exec(dsn, "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
                        "AND state = 'idle in transaction'") == [(0,)]


def test_pg_a_reset_is_sent_at_once_and_its_answer_read_before_the_next_call(pg, monkeypatch):
    """S5 without a second wait: after a write the session's `DISCARD ALL` is sent and the session pooled before
    its answer is read. The server runs it at once (a session advisory lock is free again with no further call),
    the next call reads the answer before its statement and finds nothing of the last caller's, and a session
    whose reset answer is not a clean COMMAND_OK (here: its server process ended while it sat idle) is discarded
    before anything runs on it, so the next write runs on a fresh session instead of failing. Without the
    library (no libpq found) the reset waits for its answer as before."""
    import time
    c, dsn = pg

    def write(sql, args=()):
        return c.run(sql, args, write=True, timeout=None, max_rows=None)

    write("SELECT pg_advisory_lock(4243), set_config('myapp.w', 'leak', false)")
    (idle,) = c._idle[True]
    assert idle.pending, "the reset was not sent ahead"
    deadline = time.monotonic() + 5
    while pg_exec(dsn, "SELECT pg_try_advisory_lock(4243)") != [(True,)]:
        assert time.monotonic() < deadline, "the lock outlived the call"
        time.sleep(0.01)
    assert c._idle[True] == [idle] and idle.pending   # released by the reset alone: the session was not used
    opened = c.opened
    assert write("SELECT current_setting('myapp.w', true)")[1] == [("",)]
    assert c.opened == opened and c._idle[True] == [idle]   # the same session, its reset read and clean

    pid = write("SELECT pg_backend_pid()")[1][0][0]
    assert c._idle[True][0].pending
    pg_exec(dsn, f"SELECT pg_terminate_backend({pid})")
    while pg_exec(dsn, f"SELECT 1 FROM pg_stat_activity WHERE pid = {pid}"):   # it has ended, idle in the pool
        assert time.monotonic() < deadline + 5
        time.sleep(0.01)
    assert write("SELECT pg_backend_pid()")[1][0][0] != pid   # a fresh session; no 502 for a session never used
    assert c.opened == opened + 1

    monkeypatch.setattr(connectors._LIBPQ, "lib", None)
    monkeypatch.setattr(connectors._LIBPQ, "tried", True)
    write("SELECT set_config('myapp.w', 'leak', false)")
    assert not c._idle[True][0].pending
    assert write("SELECT current_setting('myapp.w', true)")[1] == [("",)]


def test_pg_unreachable_sentence_does_not_depend_on_the_password():
    row = {"name": "gone", "db": "postgres", "host": "127.0.0.1", "port": free_port(), "user": "u",
           "database": "d", "options": {}}
    msgs = set()
    for pw in ("hunter2", "x", None):
        with pytest.raises(Unreachable) as ei:
            connectors.make(row, pw, CFG).run("SELECT 1", (), write=False, timeout=None, max_rows=None)
        assert status_of(ei.value) == 502 and ei.value.code == "connection_failed"
        msgs.add(ei.value.message)
    assert len(msgs) == 1 and "gone" in msgs.pop()


def test_pg_privileges_flag_superuser_and_plain_role(pg):
    c, _ = pg
    p = c.privileges()
    assert p["privileged"] and p["superuser"] and "rolsuper" in p["detail"]
    plain = connectors.make({"name": "plain", "db": "postgres", "host": "127.0.0.1", "port": 5432,
                             "user": "qag_dbsess_plain", "database": "qag_dbsess", "options": {}}, None, CFG)
    try:
        assert plain.privileges() == {"superuser": False, "server_files": False, "privileged": False, "detail": []}
    finally:
        plain.close()


@pytest.fixture(scope="module")
def my():
    mysql_exec("DROP DATABASE IF EXISTS qag_dbsess")
    mysql_exec("CREATE DATABASE qag_dbsess")
    mysql_exec("CREATE TABLE qag_dbsess.t (id INT PRIMARY KEY, email VARCHAR(40))")
    mysql_exec("INSERT INTO qag_dbsess.t VALUES (1, 'ada@example.com')")
    row = {"name": "my", "db": "mysql", "host": "127.0.0.1", "port": 3306, "user": "root", "database": "qag_dbsess",
           "options": {}}
    c = connectors.make(row, "", CFG)
    yield c
    c.close()


def test_mysql_user_variables_and_locks_do_not_reach_the_next_caller(my):
    one(my, "SELECT @leak := 'ada@example.com'")
    assert one(my, "SELECT @leak") == [(None,)]
    one(my, "SELECT GET_LOCK('qag_dbsess', 0)")
    assert mysql_exec("SELECT IS_FREE_LOCK('qag_dbsess')") == [(1,)]
    one(my, "SELECT LAST_INSERT_ID(42)")
    assert one(my, "SELECT LAST_INSERT_ID()") == [(0,)]


def test_mysql_read_is_read_only_and_limited_per_statement(my):
    assert one(my, "SELECT @@tx_read_only, @@max_statement_time") == [(1, 2.0)]
    assert one(my, "SELECT @@max_statement_time", timeout=0.0004) == [(0.01,)]  # never 0 (no limit)
    with pytest.raises(QueryFailed):
        one(my, "DELETE FROM t")
    with pytest.raises(Timeout) as ei:
        one(my, "SELECT SLEEP(1)", timeout=0.2)
    assert ei.value.code == "query_timeout" and ei.value.extra["timeout"] == 0.2


def test_mysql_privileges_flag_root(my):
    p = my.privileges()
    assert p["privileged"] and set(p["detail"]) == {"FILE", "SUPER"}
