"""Every refusal the store (and the roles table) raises as a domain error reaches the caller as the Management API
answered it when its handlers built the answer themselves: status, the whole body, no-store, on a real SQLite
store and on PostgreSQL (qag/errors.py -> qag/http/errors.py)."""
from __future__ import annotations

import sqlite3

import falcon.testing
import pytest

from qag import config
from qag.http.app import create_app
from tests.conftest import pg_fresh_db

A = {"X-API-Key": "adm", "X-Request-Id": "rid-1"}


@pytest.fixture(params=["sqlite", "postgres"])
def client(request, tmp_path):
    env = {"QAG_HOME": str(tmp_path / "home"), "QAG_ADMIN_KEY": "adm"}
    if request.param == "postgres":
        env["QAG_DATABASE_URL"] = pg_fresh_db("qag_domain_refusals")
    app = create_app(config.load(env))
    c = falcon.testing.TestClient(app)
    data = str(tmp_path / "data.db")
    db = sqlite3.connect(data)
    db.execute("CREATE TABLE t (id INTEGER PRIMARY KEY)")
    db.commit()
    db.close()
    assert c.simulate_post("/api/v1/connections", json={"name": "c1", "db": "sqlite", "database": data},
                           headers=A).status_code == 201
    assert c.simulate_post("/api/v1/queries", json={"name": "q1", "connection_name": "c1", "sql": "SELECT id FROM t",
                                                    "publish": True}, headers=A).status_code == 201
    assert c.simulate_post("/api/v1/queries", json={"name": "q0", "connection_name": "c1", "sql": "SELECT 1"},
                           headers=A).status_code == 201
    assert c.simulate_post("/api/v1/api-keys", json={"name": "k1"}, headers=A).status_code == 201
    assert c.simulate_post("/api/v1/roles", json={"name": "r1"}, headers=A).status_code == 201
    yield c
    app.runtime.close()
    app.runtime.store.close()


def _refused(r, status: int, code: str, sentence: str) -> None:
    assert r.status_code == status, r.text
    assert r.json == {"error": sentence, "code": code, "request_id": "rid-1"}, r.text
    assert r.headers["cache-control"] == "no-store" and r.headers["x-request-id"] == "rid-1"


def test_conflicts(client):
    c = client
    _refused(c.simulate_post("/api/v1/connections", json={"name": "c1", "db": "postgres"}, headers=A), 409,
             "connection_exists", "A connection named 'c1' exists; PATCH it or pick another name.")
    _refused(c.simulate_post("/api/v1/queries", json={"name": "q1", "connection_name": "c1", "sql": "SELECT 1"},
                             headers=A), 409,
             "query_exists", "A query named 'q1' exists; add a version with POST /api/v1/queries/q1/versions.")
    _refused(c.simulate_post("/api/v1/api-keys", json={"name": "k1"}, headers=A), 409,
             "key_exists", "An API key named 'k1' exists; PATCH it, rotate it or pick another name.")
    _refused(c.simulate_post("/api/v1/roles", json={"name": "r1"}, headers=A), 409,
             "role_exists", "A role named 'r1' exists; PATCH it or pick another name.")


def test_in_use(client):
    _refused(client.simulate_delete("/api/v1/connections/c1", headers=A), 409, "connection_in_use",
             "Saved queries still use 'c1': q0, q1; delete or move them first.")
    assert client.simulate_get("/api/v1/connections/c1", headers=A).status_code == 200  # nothing was deleted


def test_not_found(client):
    c = client
    no_conn = (404, "connection_not_found", "There is no connection named 'nope'.")
    _refused(c.simulate_patch("/api/v1/connections/nope", json={"host": "h"}, headers=A), *no_conn)
    _refused(c.simulate_delete("/api/v1/connections/nope", headers=A), *no_conn)
    no_query = (404, "query_not_found", "There is no saved query named 'nope'.")
    _refused(c.simulate_delete("/api/v1/queries/nope", headers=A), *no_query)
    _refused(c.simulate_post("/api/v1/queries/nope/publish", json={"version": 1}, headers=A), *no_query)
    _refused(c.simulate_post("/api/v1/queries/q1/publish", json={"version": 7}, headers=A), 404,
             "version_not_found", "The query 'q1' has no version 7.")
    no_key = (404, "key_not_found", "There is no API key named 'nope'.")
    _refused(c.simulate_patch("/api/v1/api-keys/nope", json={"active": False}, headers=A), *no_key)
    _refused(c.simulate_delete("/api/v1/api-keys/nope", headers=A), *no_key)
    _refused(c.simulate_post("/api/v1/api-keys/nope/rotate", json={}, headers=A), *no_key)
    no_role = (404, "role_not_found", "There is no role named 'nope'.")
    _refused(c.simulate_patch("/api/v1/roles/nope", json={"description": "x"}, headers=A), *no_role)
    _refused(c.simulate_delete("/api/v1/roles/nope", headers=A), *no_role)
    # and what exists still goes: the refusals above changed nothing
    assert c.simulate_delete("/api/v1/queries/q0", headers=A).status_code == 204
    assert c.simulate_delete("/api/v1/roles/r1", headers=A).status_code == 204
    assert c.simulate_delete("/api/v1/api-keys/k1", headers=A).status_code == 204
