"""The caller's catalog and schema in-process on a real SQLite file and PostgreSQL: /catalog lists exactly what /q
would run for this caller (grants, publication, governance), with parameters, formats, writes and masking;
/connections/{name}/schema shows only allowed tables, with masking flags, and only for granted connections."""
from __future__ import annotations

import sqlite3

import pytest

from tests.conftest import pg_exec, pg_fresh_db

A = {"X-API-Key": "adm"}


def post(c, path, body, status=201):
    r = c.simulate_post(path, json=body, headers=A)
    assert r.status_code == status, r.text
    return r


@pytest.fixture()
def seeded(app_client, tmp_path):
    path = str(tmp_path / "data.db")
    db = sqlite3.connect(path)
    db.executescript("CREATE TABLE people (id INTEGER PRIMARY KEY, name TEXT, email TEXT);"
                     "CREATE TABLE secrets (id INTEGER PRIMARY KEY, pin TEXT);"
                     "INSERT INTO people VALUES (1, 'ann', 'ann@x.org'); INSERT INTO secrets VALUES (1, '1234');")
    db.commit()
    db.close()
    c = app_client
    post(c, "/api/v1/connections", {"name": "lite", "db": "sqlite", "database": path})
    post(c, "/api/v1/connections", {"name": "other", "db": "sqlite", "database": path})
    post(c, "/api/v1/queries", {"name": "person", "connection_name": "lite", "publish": True, "cache_ttl": 30,
                                "description": "One person", "sql": "SELECT id, name, email FROM people WHERE id = :id",
                                "parameters": {"id": {"type": "int", "min": 1}}})
    post(c, "/api/v1/queries", {"name": "pins", "connection_name": "lite", "publish": True,
                                "sql": "SELECT id, pin FROM secrets"})
    post(c, "/api/v1/queries", {"name": "draft", "connection_name": "lite", "publish": False,
                                "sql": "SELECT id FROM people"})
    post(c, "/api/v1/queries", {"name": "elsewhere", "connection_name": "other", "publish": True,
                                "sql": "SELECT id FROM people"})
    k = post(c, "/api/v1/api-keys", {"name": "scoped", "connections": ["lite"],
                                     "allowed_tables": ["people"],
                                     "mask": [{"column": "people.email", "action": "mask"}]}).json["secret"]
    c.key = {"X-API-Key": k}
    return c


def test_catalog_lists_what_q_would_run(seeded):
    c = seeded
    r = c.simulate_get("/catalog", headers=c.key)
    assert r.status_code == 200, r.text
    items = {i["name"]: i for i in r.json["items"]}
    # pins reads a table outside the allow-list, draft is unpublished, elsewhere's connection is not granted
    assert set(items) == {"person"}
    p = items["person"]
    assert p["parameters"]["id"]["type"] == "int" and p["parameters"]["id"]["min"] == 1
    assert p["cache_ttl"] == 30 and p["writes"] is False and "parquet" in p["formats"] and "csv" in p["stream_formats"]
    assert p["masking"] == [{"position": 3, "column": "email", "action": "mask"}]
    for name in ("pins", "draft", "elsewhere"):
        assert c.simulate_get(f"/q/{name}", headers=c.key).status_code in (403, 404), name
    assert c.simulate_get("/q/person", query_string="id=1", headers=c.key).status_code == 200
    admin = {i["name"] for i in c.simulate_get("/catalog", headers=A).json["items"]}
    assert admin == {"person", "pins", "elsewhere"}
    assert c.simulate_get("/catalog").json["code"] == "unauthorized"
    assert c.simulate_get("/catalog", headers={"X-API-Key": "sk_nope"}).status_code == 401


def test_schema_filters_by_allowed_tables_and_flags_masks(seeded):
    c = seeded
    r = c.simulate_get("/connections/lite/schema", headers=c.key)
    assert r.status_code == 200, r.text
    tables = {t["name"]: t for t in r.json["tables"]}
    assert set(tables) == {"people"}
    cols = {col["name"]: col for col in tables["people"]["columns"]}
    assert cols["email"] == {"name": "email", "masked": True, "mask": "mask"} and cols["id"]["masked"] is False
    for name in ("other", "nope"):
        r = c.simulate_get(f"/connections/{name}/schema", headers=c.key)
        assert r.status_code == 403 and r.json["code"] == "connection_forbidden"
    assert {t["name"] for t in c.simulate_get("/connections/lite/schema", headers=A).json["tables"]} == \
        {"people", "secrets"}
    assert c.simulate_get("/connections/nope/schema", headers=A).json["code"] == "connection_not_found"


def test_schema_on_postgres_hides_the_catalog_and_other_schemas(app_client):
    dsn = pg_fresh_db("qag_core_catalog")
    pg_exec(dsn, "CREATE SCHEMA billing; CREATE TABLE public.customers (id int, email text);"
                 "CREATE TABLE billing.cards (id int, pan text)")
    c = app_client
    post(c, "/api/v1/connections", {"name": "pg", "db": "postgres", "host": "127.0.0.1", "port": 5432,
                                    "user": "postgres", "database": "qag_core_catalog"})
    k = post(c, "/api/v1/api-keys", {"name": "k", "connections": ["pg"], "allowed_tables": ["public.*"],
                                     "mask": [{"column": "*.customers.email", "action": "hash"}]}).json["secret"]
    r = c.simulate_get("/connections/pg/schema", headers={"X-API-Key": k})
    assert r.status_code == 200, r.text
    assert [(t["schema"], t["name"]) for t in r.json["tables"]] == [("public", "customers")]
    assert r.json["tables"][0]["columns"][1] == {"name": "email", "masked": True, "mask": "hash"}
    every = {(t["schema"], t["name"]) for t in c.simulate_get("/connections/pg/schema", headers=A).json["tables"]}
    assert every == {("public", "customers"), ("billing", "cards")}
