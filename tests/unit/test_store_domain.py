"""The store's SQL per dialect and the domain errors' one mapping to the HTTP contract (no I/O).

- pg_paramstyle: a `?` is a marker only outside literals, quoted identifiers, dollar quotes and comments; every
  `%` is doubled for psycopg2 (which formats the whole text once it is given parameters).
- store_migrations: each dialect runs what is written for it; a released migration never changes (its text is
  pinned by hash: an edit must be a new migration, or stores already past it would never run it).
- qag/http/errors.py: each domain error's status, code, sentence and extras, byte for byte as the contract
  (and the handlers before the split) answered them.
"""
from __future__ import annotations

import hashlib

import pytest

from qag import errors as E
from qag import store_migrations as M
from qag.http.errors import answer, status_of
from qag.store import pg_paramstyle


@pytest.mark.parametrize("sql, want", [
    ("SELECT a FROM t WHERE b = ? AND c = ?", "SELECT a FROM t WHERE b = %s AND c = %s"),
    ("SELECT '?', ?", "SELECT '?', %s"),
    ("SELECT 'it''s ?', ?", "SELECT 'it''s ?', %s"),
    ('SELECT "odd?name" FROM t WHERE x = ?', 'SELECT "odd?name" FROM t WHERE x = %s'),
    ('SELECT "a""?" , ?', 'SELECT "a""?" , %s'),
    ("SELECT 1 -- why?\nWHERE x = ?", "SELECT 1 -- why?\nWHERE x = %s"),
    ("SELECT /* a /* nested ? */ still ? */ ?", "SELECT /* a /* nested ? */ still ? */ %s"),
    ("SELECT $$ ? $$, ?", "SELECT $$ ? $$, %s"),
    ("SELECT $fn$ it's ? $fn$, ?", "SELECT $fn$ it's ? $fn$, %s"),
    ("SELECT E'\\\\' , ?", "SELECT E'\\\\' , %s"),       # E'\\' is one backslash: the literal ends there
    ("SELECT E'\\' ?', ?", "SELECT E'\\' ?', %s"),         # E'\' ?' : the quote is escaped, ? is inside
    ("SELECT 'a%' LIKE ?, 7 % 2", "SELECT 'a%%' LIKE %s, 7 %% 2"),
    ("SELECT $1, ?", "SELECT $1, %s"),
    ("SELECT 1", "SELECT 1"),
])
def test_pg_paramstyle_converts_markers_only(sql, want):
    assert pg_paramstyle(sql) == want


def test_store_statements_reach_postgres_unchanged_but_for_markers():
    """Every migration statement has neither `?` nor `%`: on PostgreSQL it runs exactly as written."""
    for m in M.MIGRATIONS:
        for stmt in M.render(m, "postgres"):
            assert "?" not in stmt and "%" not in stmt and pg_paramstyle(stmt) == stmt


# sha256 of each migration's statements as each dialect runs them, joined by "\n;\n". These equal what the store
# ran before the migrations were written per dialect (the SQLite text, with a string replacement for PostgreSQL).
RELEASED = {
    ("sqlite", 1): "5438b2de0401d731984873ba6e0e456f99be7427dc1b487f6331ded6d9f9a331",
    ("sqlite", 2): "e2beae23ab60d2f70158f217d3f55847ae89c9329a8d5e4e41c4daae6633cde0",
    ("sqlite", 3): "ecc88ce183c674259f9b237dc84ab7655b2266f23c59d160d288d00d6a658f99",
    ("postgres", 1): "7eeacfff7187c9ae67894ab21e9fe69c461292bb4ed4574462efb332eba520d7",
    ("postgres", 2): "e2beae23ab60d2f70158f217d3f55847ae89c9329a8d5e4e41c4daae6633cde0",
    ("postgres", 3): "9f6a18523502e143576333fdf4c8ee638cc85d139840352f5df40e5b37d828af",
}


@pytest.mark.parametrize("dialect", M.DIALECTS)
def test_released_migrations_never_change(dialect):
    versions = [m.version for m in M.MIGRATIONS]
    assert versions == list(range(1, len(versions) + 1)) and M.LATEST == versions[-1]
    for m in M.MIGRATIONS:
        if (dialect, m.version) not in RELEASED:
            continue  # a migration newer than this test: add its hash here when it is released
        text = "\n;\n".join(M.render(m, dialect))
        assert hashlib.sha256(text.encode()).hexdigest() == RELEASED[(dialect, m.version)], m.version


def test_each_dialect_runs_its_own_statements():
    sqlite, pg = (M.render(M.MIGRATIONS[0], d) for d in ("sqlite", "postgres"))
    assert [s for s in sqlite if "qag_audit" in s][0].count("id INTEGER PRIMARY KEY") == 1
    assert [s for s in pg if "qag_audit" in s][0].count("id BIGSERIAL PRIMARY KEY") == 1
    three = {d: M.render(M.MIGRATIONS[2], d) for d in M.DIALECTS}
    assert len(three["postgres"]) == 2 and "plpgsql" in three["postgres"][0]
    assert len(three["sqlite"]) == 1 and "AFTER INSERT" in three["sqlite"][0]
    with pytest.raises(ValueError):
        M.render(M.MIGRATIONS[0], "mysql")


def test_schema_too_new_names_both_versions():
    e = E.SchemaTooNew(7, 3)
    assert str(e) == ("the metadata store's schema is version 7, newer than this qag knows (version 3); upgrade "
                      "qag on this host, or point it at another store")


def _wire(exc, **kw):
    err = answer(exc, **kw)
    return err.status, err.body("r1"), err.headers


def test_store_errors_answer_as_the_contract():
    assert _wire(E.NotFound("connection_not_found", "There is no connection named 'a'.")) == (
        404, {"error": "There is no connection named 'a'.", "code": "connection_not_found", "request_id": "r1"}, {})
    assert _wire(E.Conflict("key_exists", "An API key named 'k' exists; PATCH it, rotate it or pick another "
                                          "name.")) == (
        409, {"error": "An API key named 'k' exists; PATCH it, rotate it or pick another name.", "code": "key_exists",
              "request_id": "r1"}, {})
    assert _wire(E.InUse("connection_in_use", "Saved queries still use 'c': a, b; delete or move them first.",
                         ["a", "b"]))[:2] == (
        409, {"error": "Saved queries still use 'c': a, b; delete or move them first.", "code": "connection_in_use",
              "request_id": "r1"})
    down = E.StoreUnavailable("cannot reach the metadata store at postgresql://u:********@h/db: refused")
    assert _wire(down) == (503, {"error": "The metadata store is unreachable right now; retry shortly.",
                                 "code": "store_unavailable", "request_id": "r1"}, {"Retry-After": "1"})
    assert "refused" in str(down)  # for `qag serve`'s one line, never for a caller
    assert _wire(E.SecretKeyProblem("secret_key_mismatch", "x."))[:2] == (
        500, {"error": "x.", "code": "secret_key_mismatch", "request_id": "r1"})
    assert answer(E.Conflict()) is None  # a unique constraint no store method named: 500 internal_error


def test_connector_errors_answer_as_the_contract():
    un = E.Unreachable("crm", "could not connect to server: Connection refused")
    want = "Could not reach the database of connection 'crm'; check that it is running and reachable, then retry."
    assert _wire(un) == (502, {"error": want, "code": "connection_failed", "request_id": "r1"}, {})
    assert _wire(un, admin=True)[1]["error"] == want + " The database said: could not connect to server: " \
                                                       "Connection refused"
    assert _wire(E.Unreachable("crm"), admin=True)[1]["error"] == want
    assert _wire(E.Timeout(0.5)) == (504, {"error": "The statement ran longer than its time limit of 0.5 s and was "
                                                    "cancelled.", "code": "query_timeout", "request_id": "r1",
                                           "timeout": 0.5}, {})
    qf = E.QueryFailed('relation "nope" does not exist')
    assert answer(qf) is None  # outside a data call: qag's own failure, as before
    assert _wire(qf, data_call=True)[:2] == (500, {
        "error": "The database rejected the statement; an administrator can see why in the run history.",
        "code": "query_failed", "request_id": "r1"})
    assert _wire(qf, data_call=True, admin=True)[1]["error"] == \
        'The database rejected the statement: relation "nope" does not exist'
    assert _wire(E.DriverMissing("psycopg2 is not installed: pip install 'qag[postgres]'"))[:2] == (
        500, {"error": "psycopg2 is not installed: pip install 'qag[postgres]'", "code": "driver_missing",
              "request_id": "r1"})
    assert answer(E.StoreUnavailable("x"), data_call=True) is None  # no run of the query: 503 as it is
    assert status_of(E.Timeout(1)) == 504 and status_of(E.ApiError(418, "x", "y")) == 418
