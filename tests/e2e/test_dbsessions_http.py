"""Through `qag serve`: the database's words reach administrators only (500 and 502), a caller cannot take the
time limit away (?timeout), session state set by one call is gone for the next, and a privileged connection
is flagged by /connections/test and refused to governed keys unless allowed (connectors S3, S5, S7, S8)."""
from __future__ import annotations

import json

import pytest
import requests

from tests.conftest import pg_exec, pg_fresh_db, start_server

J = {"Content-Type": "application/json"}


@pytest.fixture(scope="module")
def srv():
    dsn = pg_fresh_db("qag_dbsess_http")
    pg_exec(dsn, "CREATE TABLE customers (id int PRIMARY KEY, email text)")
    pg_exec(dsn, "INSERT INTO customers VALUES (1, 'ada@example.com')")
    if not pg_exec(dsn, "SELECT 1 FROM pg_roles WHERE rolname = 'qag_dbsess_plain'"):
        pg_exec(dsn, "CREATE ROLE qag_dbsess_plain LOGIN")
    pg_exec(dsn, "GRANT SELECT ON customers TO qag_dbsess_plain")
    # a user-defined function that changes the session (a plain key may call it; governance reads it as a read)
    pg_exec(dsn, "CREATE FUNCTION sneaky(p text) RETURNS text LANGUAGE sql AS "
                 "$$ SELECT set_config('search_path', p, false) || pg_advisory_lock(4343)::text $$")
    pg_exec(dsn, "CREATE VIEW settings_view AS SELECT set_config('search_path', 'from_view', false) AS s")
    # row-level security whose policy changes the session: reading the table runs it, the statement names nothing
    pg_exec(dsn, "CREATE FUNCTION policy_leak() RETURNS boolean LANGUAGE plpgsql AS "
                 "$$ BEGIN PERFORM set_config('search_path', 'from_policy', false); RETURN true; END $$")
    pg_exec(dsn, "CREATE TABLE notes (id int PRIMARY KEY)")
    pg_exec(dsn, "INSERT INTO notes VALUES (1), (2)")
    pg_exec(dsn, "ALTER TABLE notes ENABLE ROW LEVEL SECURITY")
    pg_exec(dsn, "CREATE POLICY notes_leak ON notes FOR SELECT USING (policy_leak())")
    pg_exec(dsn, "GRANT SELECT ON notes TO qag_dbsess_plain")
    s = start_server({"QAG_QUERY_TIMEOUT": "5"})
    conns = {"su": {"user": "postgres"}, "plain": {"user": "qag_dbsess_plain"}}
    for name, extra in conns.items():
        post(s, "/api/v1/connections", {"name": name, "db": "postgres", "host": "127.0.0.1", "port": 5432,
                                        "database": "qag_dbsess_http", "password": "pw-s3cret", **extra})
    # "gone": reached when it is saved (an active connection is), then its database goes away
    gone = pg_fresh_db("qag_dbsess_gone")
    post(s, "/api/v1/connections", {"name": "gone", "db": "postgres", "host": "127.0.0.1", "port": 5432,
                                    "user": "postgres", "password": "pw-s3cret", "database": "qag_dbsess_gone"})
    pg_exec(gone.rsplit("/", 1)[0] + "/postgres", "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
            "WHERE datname = 'qag_dbsess_gone'")
    pg_exec(gone.rsplit("/", 1)[0] + "/postgres", "DROP DATABASE qag_dbsess_gone")
    queries = {
        "stat": ("su", "SELECT pg_stat_file(:f) IS NOT NULL AS x", {"f": "str"}),
        "gone": ("gone", "SELECT 1 AS one", {}),
        "sleep": ("su", "SELECT pg_sleep(:s) IS NULL AS slept", {"s": "float"}),
        "setpath": ("su", "SELECT sneaky(:p) AS s", {"p": "str"}),
        "getpath": ("su", "SELECT current_setting('search_path') AS sp", {}),
        "viewpath": ("su", "SELECT s FROM settings_view", {}),
        "notes": ("plain", "SELECT id FROM notes ORDER BY id", {}),
        "getpath_plain": ("plain", "SELECT current_setting('search_path') AS sp", {}),
        "email_su": ("su", "SELECT id, email FROM customers WHERE id = :id", {"id": "int"}),
        "email_plain": ("plain", "SELECT id, email FROM customers WHERE id = :id", {"id": "int"}),
    }
    for q, (conn, sql, params) in queries.items():
        post(s, "/api/v1/queries", {"name": q, "connection_name": conn, "sql": sql, "parameters": params,
                                    "publish": True, "allow_unsafe": q == "stat"})
    s.keys = {
        "plain": post(s, "/api/v1/api-keys", {"name": "plain", "queries": ["*"], "connections": ["su", "gone"]}
                      )["secret"],
        "masked": post(s, "/api/v1/api-keys", {"name": "masked", "queries": ["email_su", "email_plain"],
                                               "connections": ["su", "plain"],
                                               "mask": [{"column": "customers.email", "action": "mask"}]})["secret"],
        "notes": post(s, "/api/v1/api-keys", {"name": "notes", "queries": ["notes", "getpath_plain"],
                                              "connections": ["plain"]})["secret"],
    }
    yield s
    s.stop()


def post(s, path, body, expect=(200, 201)):
    r = requests.post(s.base + path, headers={**s.admin, **J}, data=json.dumps(body))
    assert r.status_code in expect, r.text
    return r.json()


def get(s, path, key):
    return requests.get(s.base + path, headers={"X-API-Key": key})


def test_statement_error_text_reaches_administrators_only(srv):
    r = get(srv, "/q/stat?f=ada@example.com", srv.keys["plain"])
    assert r.status_code == 500 and r.json()["code"] == "query_failed", r.text  # 58P01 is not 502
    assert "ada@example.com" not in r.text and "could not" not in r.json()["error"]
    r = get(srv, "/q/stat?f=ada@example.com", srv.env["QAG_ADMIN_KEY"])
    assert r.status_code == 500 and 'could not stat file "ada@example.com"' in r.json()["error"]


def test_unreachable_sentence_is_fixed_for_keys_and_detailed_for_administrators(srv):
    r = get(srv, "/q/gone", srv.keys["plain"])
    assert r.status_code == 502 and r.json()["code"] == "connection_failed"
    assert r.json()["error"] == ("Could not reach the database of connection 'gone'; check that it is running and "
                                 "reachable, then retry.")
    r = get(srv, "/q/gone", srv.env["QAG_ADMIN_KEY"])
    assert r.status_code == 502 and "The database said:" in r.json()["error"] and "pw-s3cret" not in r.text


@pytest.mark.parametrize("raw", ["0", "-1", "abc", "nan", "inf"])
def test_timeout_that_is_not_a_positive_number_is_400_invalid_timeout(srv, raw):
    r = get(srv, f"/q/getpath?timeout={raw}", srv.keys["plain"])
    assert r.status_code == 400 and r.json()["code"] == "invalid_timeout", r.text


def test_a_tiny_timeout_is_ten_milliseconds_not_no_limit(srv):
    r = get(srv, "/q/sleep?s=1&timeout=0.0004", srv.keys["plain"])
    assert r.status_code == 504 and r.json()["code"] == "query_timeout" and r.json()["timeout"] == 0.01, r.text
    r = get(srv, "/q/sleep?s=0.2&timeout=999", srv.keys["plain"])  # above the server's limit: the server's
    assert r.status_code == 200, r.text


def test_session_settings_of_one_call_are_gone_for_the_next(srv):
    for _ in range(12):
        assert get(srv, "/q/setpath?p=evil", srv.keys["plain"]).status_code == 200
    paths = {get(srv, "/q/getpath", srv.keys["plain"]).json()[0]["sp"] for _ in range(24)}
    assert paths == {'"$user", public'}
    assert pg_exec("postgresql://postgres@127.0.0.1:5432/qag_dbsess_http",
                   "SELECT pg_try_advisory_lock(4343)") == [(True,)]  # no pooled session still holds it
    # a view's definition may change the session although the statement names no function
    for _ in range(12):
        assert get(srv, "/q/viewpath", srv.keys["plain"]).json() == [{"s": "from_view"}]
    assert {get(srv, "/q/getpath", srv.keys["plain"]).json()[0]["sp"] for _ in range(24)} == {'"$user", public'}


def test_a_read_of_a_table_with_row_security_is_reset_after(srv):
    """Row-level security's policies run on every read of the table (the connection's role is not its owner, so
    they apply): a policy that changes the session is code the statement does not name, like a view's, and the
    read is not proven state-free."""
    for _ in range(12):
        assert get(srv, "/q/notes", srv.keys["notes"]).json() == [{"id": 1}, {"id": 2}]
    paths = {get(srv, "/q/getpath_plain", srv.keys["notes"]).json()[0]["sp"] for _ in range(24)}
    assert paths == {'"$user", public'}


def test_privileged_connection_is_flagged_and_refused_to_governed_keys(srv):
    t = post(srv, "/api/v1/connections/test", {"name": "su"})
    assert t["privileged"] is True and t["superuser"] is True and "rolsuper" in t["privileges"]
    assert t["governed_keys_allowed"] is False
    t = post(srv, "/api/v1/connections/test", {"name": "plain"})
    assert t["privileged"] is False and t["governed_keys_allowed"] is True
    r = get(srv, "/q/email_su?id=1", srv.keys["masked"])
    assert r.status_code == 403 and r.json()["code"] == "connection_privileged", r.text
    assert "ada@example.com" not in r.text
    r = get(srv, "/q/email_plain?id=1", srv.keys["masked"])  # a plain role: served, masked
    assert r.status_code == 200 and r.json()[0]["email"] != "ada@example.com", r.text
    assert get(srv, "/q/email_su?id=1", srv.env["QAG_ADMIN_KEY"]).status_code == 200  # administrators: no governance
    r = requests.patch(srv.base + "/api/v1/connections/su", headers={**srv.admin, **J},
                       data=json.dumps({"options": {"allow_superuser": True}}))
    assert r.status_code == 200, r.text
    r = get(srv, "/q/email_su?id=1", srv.keys["masked"])
    assert r.status_code == 200 and r.json()[0]["email"] != "ada@example.com", r.text
