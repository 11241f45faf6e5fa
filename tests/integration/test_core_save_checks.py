"""Checks at save, in-process on real SQLite, PostgreSQL and MariaDB: a statement over a table or column that does
not exist is refused when it is saved (400 invalid_sql with the database's reason), never at the first caller;
a statement on a connection that cannot be reached now is saved unchecked; POST /api/v1/queries/validate answers
the same checks as data, never runs the statement and never fails for the body's content."""
from __future__ import annotations

import sqlite3

import pytest

from tests.conftest import mysql_exec, pg_exec, pg_fresh_db

A = {"X-API-Key": "adm"}


def post(c, path, body):
    return c.simulate_post(path, json=body, headers=A)


@pytest.fixture()
def conns(app_client, tmp_path):
    c = app_client
    path = str(tmp_path / "d.db")
    db = sqlite3.connect(path)
    db.executescript("CREATE TABLE t (id INTEGER, name TEXT); CREATE TABLE hits (n INTEGER);")
    db.commit()
    db.close()
    c.sqlite_path = path
    assert post(c, "/api/v1/connections", {"name": "lite", "db": "sqlite", "database": path}).status_code == 201
    pg_fresh_db("qag_core_savecheck")
    pg_exec("postgresql://postgres@127.0.0.1:5432/qag_core_savecheck", "CREATE TABLE t (id int, name text)")
    assert post(c, "/api/v1/connections", {"name": "pg", "db": "postgres", "host": "127.0.0.1", "port": 5432,
                                           "user": "postgres", "database": "qag_core_savecheck"}).status_code == 201
    mysql_exec("DROP DATABASE IF EXISTS qag_core_savecheck")
    mysql_exec("CREATE DATABASE qag_core_savecheck")
    mysql_exec("CREATE TABLE t (id int, name text)", database="qag_core_savecheck")
    assert post(c, "/api/v1/connections", {"name": "my", "db": "mysql", "host": "127.0.0.1", "port": 3306,
                                           "user": "root", "database": "qag_core_savecheck"}).status_code == 201
    # a connection saved on purpose before its server is up: inactive (an active one is reached first)
    assert post(c, "/api/v1/connections", {"name": "down", "db": "postgres", "host": "127.0.0.1", "port": 1,
                                           "user": "postgres", "database": "x", "active": False}).status_code == 201
    return c


@pytest.mark.parametrize("conn", ["lite", "pg", "my"])
def test_unknown_tables_and_columns_are_refused_at_save(conns, conn):
    c = conns
    for i, sql in enumerate(("SELECT nope FROM t WHERE id = :id", "SELECT id FROM missing_table",
                             "SELECT t.id FROM t JOIN t2 ON t2.id = t.id")):
        r = post(c, "/api/v1/queries", {"name": f"bad{i}", "connection_name": conn, "sql": sql, "publish": True})
        assert r.status_code == 400 and r.json["code"] == "invalid_sql", (sql, r.text)
        assert c.simulate_get(f"/api/v1/queries/bad{i}", headers=A).status_code == 404, "nothing was saved"
    ok = post(c, "/api/v1/queries", {"name": "good", "connection_name": conn, "publish": True,
                                     "sql": "SELECT id, name FROM t WHERE id = :id AND name LIKE 'a%'"})
    assert ok.status_code == 201, ok.text
    r = post(c, "/api/v1/queries/good/versions", {"sql": "SELECT id, nom FROM t"})
    assert r.status_code == 400 and r.json["code"] == "invalid_sql"


def test_a_write_is_planned_not_run(conns):
    c = conns
    c.app_obj.cfg.__dict__["allow_writes"] = True
    r = post(c, "/api/v1/queries", {"name": "w", "connection_name": "lite", "sql": "INSERT INTO hits VALUES (:n)"})
    assert r.status_code == 201, r.text
    assert sqlite3.connect(c.sqlite_path).execute("SELECT count(*) FROM hits").fetchone()[0] == 0
    r = post(c, "/api/v1/queries", {"name": "w2", "connection_name": "lite", "sql": "INSERT INTO hitz VALUES (1)"})
    assert r.status_code == 400 and r.json["code"] == "invalid_sql"


def test_an_unreachable_connection_saves_unchecked(conns):
    r = post(conns, "/api/v1/queries", {"name": "later", "connection_name": "down", "sql": "SELECT a FROM b"})
    assert r.status_code == 201, r.text


def test_validate_answers_as_data(conns):
    c = conns
    r = post(c, "/api/v1/queries/validate", {"connection_name": "pg", "sql": "SELECT id, name FROM t WHERE id = :id",
                                             "parameters": {"id": "int"}})
    assert r.status_code == 200 and r.json["valid"] is True and r.json["errors"] == []
    assert r.json["tables"] == ["public.t"] and r.json["parameters"]["id"]["type"] == "int"
    for body, code in (({"connection_name": "pg", "sql": "SELECT x FROM t"}, "invalid_sql"),
                       ({"connection_name": "pg", "sql": "SELECT 1; SELECT 2"}, "multiple_statements"),
                       ({"connection_name": "nope", "sql": "SELECT 1"}, "connection_not_found"),
                       ({"connection_name": "pg", "sql": "SELECT :a", "parameters": {"a": "complex"}}, None),
                       ({"sql": "SELECT 1"}, "field_required"),
                       ({"connection_name": "pg", "sql": "SELECT 1", "colour": 1}, "unknown_field")):
        r = post(c, "/api/v1/queries/validate", body)
        assert r.status_code == 200 and r.json["valid"] is False and r.json["errors"], (body, r.text)
        if code:
            assert r.json["errors"][0]["code"] == code, (body, r.json)
    r = c.simulate_post("/api/v1/queries/validate", body="not json", headers=A)
    assert r.status_code == 200 and r.json["valid"] is False
    assert c.simulate_post("/api/v1/queries/validate", json={}).status_code == 401
    assert c.simulate_get("/api/v1/queries", headers=A).json["items"] == [], "validate saves nothing"
