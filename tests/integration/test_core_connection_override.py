"""connection_name on /q, in-process on real SQLite files and PostgreSQL: a saved query runs on another connection of
the same kind only when the key is granted that connection (403 connection_forbidden otherwise, for unknown names
too), that connection's own governance applies, another kind is refused, and nothing runs when refused."""
from __future__ import annotations

import sqlite3

import pytest

A = {"X-API-Key": "adm"}


def post(c, path, body, status=201):
    r = c.simulate_post(path, json=body, headers=A)
    assert r.status_code == status, r.text
    return r


@pytest.fixture()
def seeded(app_client, tmp_path):
    c = app_client
    for name, rows in (("eu", [(1, "eu-ann", "ann@eu.example")]), ("us", [(1, "us-bob", "bob@us.example")])):
        path = str(tmp_path / f"{name}.db")
        db = sqlite3.connect(path)
        db.execute("CREATE TABLE people (id INTEGER, name TEXT, email TEXT)")
        db.executemany("INSERT INTO people VALUES (?, ?, ?)", rows)
        db.commit()
        db.close()
        post(c, "/api/v1/connections", {"name": name, "db": "sqlite", "database": path})
    post(c, "/api/v1/connections", {"name": "pg", "db": "postgres", "host": "127.0.0.1", "port": 5432,
                                    "user": "postgres", "database": "postgres"})
    post(c, "/api/v1/queries", {"name": "person", "connection_name": "eu", "publish": True,
                                "sql": "SELECT id, name, email FROM people WHERE id = :id",
                                "parameters": {"id": "int"}})
    k = post(c, "/api/v1/api-keys", {"name": "both", "queries": ["person"], "connections": ["eu", "us", "pg"],
                                     "mask": [{"column": "people.email", "action": "null"}]}).json["secret"]
    only = post(c, "/api/v1/api-keys", {"name": "eu_only", "queries": ["person"], "connections": ["eu"]}).json["secret"]
    c.both, c.only = {"X-API-Key": k}, {"X-API-Key": only}
    return c


def test_another_granted_connection_of_the_same_kind(seeded):
    c = seeded
    r = c.simulate_get("/q/person", query_string="id=1&connection_name=us", headers=c.both)
    assert r.status_code == 200, r.text
    assert r.json == [{"id": 1, "name": "us-bob", "email": None}], "the key's masking applies there too"
    r = c.simulate_get("/q/person", query_string="id=1", headers=c.both)
    assert r.json[0]["name"] == "eu-ann", "without connection_name the query's own connection"
    r = c.simulate_post("/q/person", json={"params": {"id": 1}, "connection_name": "us"}, headers=c.both)
    assert r.status_code == 200 and r.json[0]["name"] == "us-bob"
    r = c.simulate_get("/q/person", query_string="id=1&connection_name=us", headers=A)
    assert r.json[0]["email"] == "bob@us.example"


def test_refusals(seeded):
    c = seeded
    for name in ("us", "nope"):
        r = c.simulate_get("/q/person", query_string=f"id=1&connection_name={name}", headers=c.only)
        assert r.status_code == 403 and r.json["code"] == "connection_forbidden", r.text
    r = c.simulate_get("/q/person", query_string="id=1&connection_name=pg", headers=c.both)
    assert r.status_code == 400 and r.json["code"] == "connection_mismatch"
    r = c.simulate_get("/q/person", query_string="id=1&connection_name=nope", headers=A)
    assert r.status_code == 404 and r.json["code"] == "connection_not_found"
    r = c.simulate_post("/api/v1/queries", json={"name": "bad", "connection_name": "eu",
                                                 "sql": "SELECT :connection_name",
                                                 "parameters": {"connection_name": "str"}},
                        headers=A)
    assert r.status_code == 400, "connection_name is a reserved name, not a parameter"
