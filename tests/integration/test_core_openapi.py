"""/openapi.json is valid OpenAPI 3.1 for an anonymous caller, a scoped key and an administrator (validated by
openapi-spec-validator), its request bodies are the handlers' own field lists, every error response names the
Error schema; /docs serves Swagger UI from the package under a strict CSP, and / redirects there."""
from __future__ import annotations

import sqlite3

import pytest
from openapi_spec_validator import validate

A = {"X-API-Key": "adm"}


@pytest.fixture()
def seeded(app_client, tmp_path):
    path = str(tmp_path / "d.db")
    db = sqlite3.connect(path)
    db.executescript("CREATE TABLE t (id INTEGER, name TEXT); INSERT INTO t VALUES (1, 'a');")
    db.commit()
    db.close()
    c = app_client
    assert c.simulate_post("/api/v1/connections", json={"name": "lite", "db": "sqlite", "database": path},
                           headers=A).status_code == 201
    for name, publish in (("by_id", True), ("hidden", True), ("draft", False)):
        r = c.simulate_post("/api/v1/queries", headers=A, json={
            "name": name, "connection_name": "lite", "publish": publish, "sql": "SELECT id, name FROM t WHERE id = :id",
            "parameters": {"id": {"type": "int", "min": 1, "max": 9}}})
        assert r.status_code == 201, r.text
    r = c.simulate_post("/api/v1/api-keys", json={"name": "k", "queries": ["by_id", "draft"]}, headers=A)
    c.key = {"X-API-Key": r.json["secret"]}
    return c


def test_the_document_is_valid_openapi_31_for_every_caller(seeded):
    c = seeded
    docs = {}
    for who, headers in (("anonymous", {}), ("scoped", c.key), ("admin", A), ("bad key", {"X-API-Key": "x"})):
        r = c.simulate_get("/openapi.json", headers=headers)
        assert r.status_code == 200
        validate(r.json)  # raises on any violation of the OpenAPI 3.1 schema
        docs[who] = r.json
    assert "/q/by_id" in docs["scoped"]["paths"] and "/q/hidden" not in docs["scoped"]["paths"]
    assert "/q/draft" not in docs["admin"]["paths"] and "/q/hidden" in docs["admin"]["paths"]
    assert not any(p.startswith("/q/") and p != "/q/{name}" for p in docs["anonymous"]["paths"])
    params = {p["name"]: p for p in docs["scoped"]["paths"]["/q/by_id"]["get"]["parameters"]}
    assert params["id"]["schema"] == {"type": "integer", "minimum": 1, "maximum": 9}
    assert "parquet" in params["format"]["schema"]["enum"]


def test_operations_carry_schemas_and_error_bodies(seeded):
    doc = seeded.simulate_get("/openapi.json", headers=A).json
    for path, item in doc["paths"].items():
        for method, op in item.items():
            if method == "parameters":
                continue
            if "{name}" in path:
                assert any(p["name"] == "name" and p["in"] == "path" for p in item.get("parameters", [])), path
            for status, r in op["responses"].items():
                if path == "/mcp" and status in ("202", "400"):
                    # MCP's own envelope: a malformed message is a JSON-RPC error, an accepted notification empty
                    continue
                if status[0] in "45":
                    assert r["content"]["application/json"]["schema"] == {"$ref": "#/components/schemas/Error"}, \
                        (path, method, status)
                elif status[0] == "2" and status != "204":
                    assert "content" in r, (path, method, status)
            if method in ("post", "patch") and path.startswith("/api/v1/") and path != "/api/v1/connections/test":
                assert "requestBody" in op, (path, method)


def test_request_bodies_are_the_handlers_field_lists(seeded):
    from qag.http import manage as M
    doc = seeded.simulate_get("/openapi.json", headers=A).json
    body = lambda p, m: doc["paths"][p][m]["requestBody"]["content"]["application/json"]["schema"]
    assert set(body("/api/v1/connections", "post")["properties"]) == set(M.CONN_FIELDS)
    assert set(body("/api/v1/queries", "post")["properties"]) == set(M.QUERY_FIELDS)
    assert set(body("/api/v1/queries/{name}/versions", "post")["properties"]) == set(M.VERSION_FIELDS)
    assert set(body("/api/v1/api-keys", "post")["properties"]) == set(M.KEY_FIELDS)
    assert body("/api/v1/api-keys", "post")["additionalProperties"] is False


def test_docs_are_served_offline_under_a_strict_csp(seeded):
    c = seeded
    r = c.simulate_get("/docs")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    csp = r.headers["content-security-policy"]
    assert "script-src 'self'" in csp and "unsafe-inline" not in csp and "default-src 'none'" in csp
    assert "<script>" not in r.text and "http://" not in r.text and "https://" not in r.text
    js = c.simulate_get("/docs/static/swagger-ui-bundle.js")
    assert js.status_code == 200 and len(js.content) > 100_000 and "javascript" in js.headers["content-type"]
    assert c.simulate_get("/docs/static/swagger-ui.css").status_code == 200
    assert c.simulate_get("/docs/qag-init.js").text.count("/openapi.json") == 1
    assert c.simulate_get("/docs/static/..%2Fcore.py").status_code == 404
    assert c.simulate_get("/docs/static/core.py").status_code == 404
    r = c.simulate_get("/")
    assert r.status_code == 302 and r.headers["location"] == "/docs"
