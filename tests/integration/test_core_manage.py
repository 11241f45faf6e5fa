"""The Management API in-process on a real SQLite store (and PostgreSQL for the store-loss case): validation,
conflicts, secrets never returned or stored, versions, rotation with grace, the audit log."""
from __future__ import annotations

import json
import sqlite3

import falcon.testing
import pytest

from qag import config
from qag.http.app import create_app
from tests.conftest import pg_exec, pg_fresh_db

A = {"X-API-Key": "adm"}


def post(c, path, body, status=None):
    r = c.simulate_post(path, json=body, headers=A)
    if status is not None:
        assert r.status_code == status, r.text
    return r


@pytest.fixture()
def sqlite_db(tmp_path):
    path = str(tmp_path / "data.db")
    db = sqlite3.connect(path)
    db.executescript("CREATE TABLE t (id INTEGER PRIMARY KEY, name TEXT, email TEXT);"
                     "INSERT INTO t VALUES (1, 'ann', 'ann@x.org'), (2, 'bob', 'bob@y.org');")
    db.commit()
    db.close()
    return path


def test_connection_crud_and_password_never_shown(app_client, sqlite_db):
    c = app_client
    r = post(c, "/api/v1/connections", {"name": "pg1", "db": "postgres", "host": "127.0.0.1", "port": 5432,
                                        "user": "postgres", "password": "s3cret!", "database": "x", "active": False},
             201)
    assert r.json["password"] == "********" and "s3cret" not in r.text
    assert post(c, "/api/v1/connections", {"name": "pg1", "db": "postgres"}).json["code"] == "connection_exists"
    for body, code in (({"name": "x y", "db": "postgres"}, "invalid_name"),
                       ({"name": "ok", "db": "oracle"}, "invalid_field"),
                       ({"name": "ok", "db": "postgres", "port": "5432"}, "invalid_field"),
                       ({"name": "ok", "db": "postgres", "colour": "red"}, "unknown_field"),
                       ({"db": "postgres"}, "field_required"),
                       ({"name": "ok", "db": "sqlite"}, "field_required")):
        r = post(c, "/api/v1/connections", body)
        assert r.status_code == 400 and r.json["code"] == code, (body, r.text)
    r = c.simulate_post("/api/v1/connections", body="[1,2]", headers={**A, "Content-Type": "application/json"})
    assert r.status_code == 400 and r.json["code"] == "invalid_body"
    r = c.simulate_post("/api/v1/connections", body="x" * (2 << 20), headers=A)
    assert r.status_code == 413 and r.json["code"] == "body_too_large"
    items = c.simulate_get("/api/v1/connections", headers=A).json["items"]
    assert [i["name"] for i in items] == ["pg1"] and items[0]["password"] == "********"
    r = c.simulate_patch("/api/v1/connections/pg1", json={"password": "n3w"}, headers=A)
    assert r.status_code == 200 and "n3w" not in r.text
    assert c.simulate_get("/api/v1/connections/nope", headers=A).json["code"] == "connection_not_found"
    # the store keeps no password in the audit log
    audit = c.simulate_get("/api/v1/audit", headers=A).json["items"]
    assert "s3cret" not in json.dumps(audit) and "n3w" not in json.dumps(audit)
    assert audit[0]["after"]["password"] == "(changed)" and audit[0]["actor"] == "admin"
    assert c.simulate_delete("/api/v1/connections/pg1", headers=A).status_code == 204


def test_connection_test_route(app_client, sqlite_db):
    c = app_client
    r = post(c, "/api/v1/connections/test", {"db": "sqlite", "database": sqlite_db}, 200)
    assert r.json["ok"] is True
    r = post(c, "/api/v1/connections/test", {"db": "postgres", "host": "127.0.0.1", "port": 1, "user": "u",
                                             "password": "pw-xyz"})
    assert r.status_code == 502 and r.json["code"] == "connection_failed" and "pw-xyz" not in r.text
    post(c, "/api/v1/connections", {"name": "lite", "db": "sqlite", "database": sqlite_db}, 201)
    assert post(c, "/api/v1/connections/test", {"name": "lite"}, 200).json["ok"]


def test_admin_only(app_client):
    c = app_client
    assert c.simulate_get("/api/v1/queries").status_code == 401
    assert c.simulate_get("/api/v1/queries", headers={"X-API-Key": "wrong"}).json["code"] == "unauthorized"


def test_versions_immutable_publish_and_delete(app_client, sqlite_db):
    c = app_client
    post(c, "/api/v1/connections", {"name": "lite", "db": "sqlite", "database": sqlite_db}, 201)
    r = post(c, "/api/v1/queries", {"name": "q", "connection_name": "lite", "sql": "SELECT id FROM t WHERE id = :id",
                                    "parameters": {"id": "int"}, "publish": True}, 201)
    assert r.json["published_version"] == 1 and r.json["version"] == 1
    assert post(c, "/api/v1/queries", {"name": "q", "connection_name": "lite", "sql": "SELECT 1"}).json["code"] == \
        "query_exists"
    r = post(c, "/api/v1/queries/q/versions", {"sql": "SELECT id, name FROM t WHERE id = :id",
                                               "parameters": {"id": "int"}}, 201)
    assert r.json["version"] == 2 and r.json["published"] is False
    key = post(c, "/api/v1/api-keys", {"name": "k", "queries": ["q"]}, 201).json["secret"]
    h = {"X-API-Key": key}
    assert c.simulate_get("/q/q", params={"id": "1"}, headers=h).json == [{"id": 1}]
    post(c, "/api/v1/queries/q/publish", {"version": 2}, 200)
    assert c.simulate_get("/q/q", params={"id": "1"}, headers=h).json == [{"id": 1, "name": "ann"}]
    assert post(c, "/api/v1/queries/q/publish", {"version": 9}).json["code"] == "version_not_found"
    got = c.simulate_get("/api/v1/queries/q", headers=A).json
    assert [v["sql"] for v in got["versions"]] == ["SELECT id FROM t WHERE id = :id",
                                                   "SELECT id, name FROM t WHERE id = :id"]
    # an administrator may still call an explicit version; a scoped key only the published one (issue 12)
    assert c.simulate_get("/q/q", params={"id": "2", "version": "1"}, headers=A).json == [{"id": 2}]
    assert c.simulate_get("/q/q", params={"id": "2", "version": "2"}, headers=h).json == [{"id": 2, "name": "bob"}]
    for v in ("1", "9"):
        r = c.simulate_get("/q/q", params={"id": "2", "version": v}, headers=h)
        assert r.status_code == 404 and r.json["code"] == "version_not_found", r.text
    assert c.simulate_get("/q/q", params={"id": "2", "version": "9"}, headers=A).json["code"] == "version_not_found"
    for body, code in (({"name": "bad", "connection_name": "lite", "sql": "SELECT 1; SELECT 2"}, "multiple_statements"),
                       ({"name": "bad", "connection_name": "lite", "sql": "SELEKT"}, "invalid_sql"),
                       ({"name": "bad", "connection_name": "nope", "sql": "SELECT 1"}, "connection_not_found"),
                       ({"name": "bad", "connection_name": "lite", "sql": "SELECT :a",
                         "parameters": {"a": "date"}}, "invalid_parameters"),
                       ({"name": "bad/x", "connection_name": "lite", "sql": "SELECT 1"}, "invalid_name")):
        r = post(c, "/api/v1/queries", body)
        assert r.json["code"] == code, (body, r.text)
    assert c.simulate_get("/api/v1/queries/bad", headers=A).status_code == 404
    assert c.simulate_delete("/api/v1/queries/q", headers=A).status_code == 204
    assert c.simulate_get("/q/q", params={"id": "1"}, headers=h).json["code"] == "query_not_found"


def test_keys_secret_once_rotate_with_grace_delete(app_client, sqlite_db, home):
    c = app_client
    post(c, "/api/v1/connections", {"name": "lite", "db": "sqlite", "database": sqlite_db}, 201)
    post(c, "/api/v1/queries", {"name": "q", "connection_name": "lite", "sql": "SELECT count(*) AS n FROM t",
                                "publish": True}, 201)
    r = post(c, "/api/v1/api-keys", {"name": "k", "queries": ["q"], "rate_limit": "100/minute"}, 201)
    assert r.headers["Cache-Control"] == "no-store"
    old = r.json["secret"]
    assert old.startswith("sk_")
    got = c.simulate_get("/api/v1/api-keys/k", headers=A)
    assert "secret" not in got.json and old not in got.text
    # the store holds only the hash
    db = sqlite3.connect(f"{home}/qag.db")
    assert old not in json.dumps(db.execute("SELECT * FROM qag_api_keys").fetchall())
    for body, code in (({"name": "k2", "rate_limit": "lots"}, "invalid_body"),
                       ({"name": "k2", "allowed_ips": ["not-an-ip"]}, "invalid_field"),
                       ({"name": "k2", "expires_at": "tomorrow"}, "invalid_field"),
                       ({"name": "k2", "queries": "q"}, "invalid_field"),
                       ({"name": "k2", "allowed_write_ops": ["explode"]}, "invalid_field"),
                       ({"name": "k2", "mask": [{"column": "email", "action": "hash"}]}, "invalid_field"),
                       ({"name": "k2", "bogus": 1}, "unknown_field")):
        assert post(c, "/api/v1/api-keys", body).json["code"] == code, body
    assert post(c, "/api/v1/api-keys", {"name": "k"}).json["code"] == "key_exists"
    r = post(c, "/api/v1/api-keys/k/rotate", {"grace_minutes": 5}, 200)
    new = r.json["secret"]
    assert new != old and r.headers["Cache-Control"] == "no-store"
    assert c.simulate_get("/q/q", headers={"X-API-Key": new}).json == [{"n": 2}]
    assert c.simulate_get("/q/q", headers={"X-API-Key": old}).json == [{"n": 2}]  # within the grace period
    r = post(c, "/api/v1/api-keys/k/rotate", {"grace_minutes": 0}, 200)  # the previous secret stops at once
    newer = r.json["secret"]
    assert c.simulate_get("/q/q", headers={"X-API-Key": new}).status_code == 401
    assert c.simulate_get("/q/q", headers={"X-API-Key": newer}).status_code == 200
    assert c.simulate_patch("/api/v1/api-keys/k", json={"active": False}, headers=A).json["active"] is False
    assert c.simulate_get("/q/q", headers={"X-API-Key": newer}).status_code == 401
    assert c.simulate_patch("/api/v1/api-keys/k", json={"active": True}, headers=A).status_code == 200
    assert c.simulate_get("/q/q", headers={"X-API-Key": newer}).status_code == 200
    assert c.simulate_delete("/api/v1/api-keys/k", headers=A).status_code == 204
    assert c.simulate_get("/q/q", headers={"X-API-Key": newer}).status_code == 401
    assert c.simulate_get("/api/v1/api-keys/k", headers=A).json["code"] == "key_not_found"


def test_query_created_as_draft_by_default(app_client, sqlite_db):
    c = app_client
    post(c, "/api/v1/connections", {"name": "lite", "db": "sqlite", "database": sqlite_db}, 201)
    r = post(c, "/api/v1/queries", {"name": "d", "connection_name": "lite", "sql": "SELECT 1 AS one"}, 201)
    assert r.json["published_version"] is None
    key = post(c, "/api/v1/api-keys", {"name": "k", "queries": ["d"]}, 201).json["secret"]
    assert c.simulate_get("/q/d", headers={"X-API-Key": key}).json["code"] == "not_published"


def test_connections_grant_and_omitted_means_none(app_client, sqlite_db):
    c = app_client
    post(c, "/api/v1/connections", {"name": "lite", "db": "sqlite", "database": sqlite_db}, 201)
    post(c, "/api/v1/queries", {"name": "q", "connection_name": "lite", "sql": "SELECT 1 AS one", "publish": True}, 201)
    none = post(c, "/api/v1/api-keys", {"name": "none"}, 201).json["secret"]
    assert c.simulate_get("/q/q", headers={"X-API-Key": none}).json["code"] == "query_not_found"
    viaconn = post(c, "/api/v1/api-keys", {"name": "viaconn", "connections": ["lite"]}, 201).json["secret"]
    assert c.simulate_get("/q/q", headers={"X-API-Key": viaconn}).json == [{"one": 1}]


def test_passwords_encrypted_at_rest(tmp_path):
    home = str(tmp_path / "h")
    cfg = config.load({"QAG_HOME": home, "QAG_ADMIN_KEY": "adm", "QAG_SECRET_KEY": "a long secret"})
    app = create_app(cfg)
    c = falcon.testing.TestClient(app)
    post(c, "/api/v1/connections", {"name": "pg", "db": "postgres", "host": "127.0.0.1", "port": 5432,
                                    "user": "postgres", "password": "plain-text-pw", "database": "postgres"}, 201)
    raw = sqlite3.connect(f"{home}/qag.db").execute("SELECT password FROM qag_connections").fetchone()[0]
    assert raw.startswith("fernet:") and "plain-text-pw" not in raw
    assert app.runtime.store.connection_password(app.runtime.store.get_connection("pg")) == "plain-text-pw"
    # the wrong key cannot open it
    from qag.errors import SecretKeyProblem
    from qag.store import Store
    other = Store(home=home, secret_key="another")
    with pytest.raises(SecretKeyProblem):
        other.connection_password(other.get_connection("pg"))


def test_migrations_are_versioned_and_idempotent(home):
    from qag.store import Store
    from qag.store_migrations import MIGRATIONS
    s = Store(home=home)
    assert s.migrate() == MIGRATIONS[-1].version
    assert s.migrate() == MIGRATIONS[-1].version
    rows = sqlite3.connect(f"{home}/qag.db").execute("SELECT version FROM qag_schema_version").fetchall()
    assert [r[0] for r in rows] == [m.version for m in MIGRATIONS]
    assert sqlite3.connect(f"{home}/qag.db").execute("PRAGMA journal_mode").fetchone()[0] == "wal"


def test_store_lost_later_gives_503_and_recovers(tmp_path):
    dsn = pg_fresh_db("qag_core_lost")
    cfg = config.load({"QAG_HOME": str(tmp_path), "QAG_ADMIN_KEY": "adm", "QAG_DATABASE_URL": dsn})
    app = create_app(cfg)
    c = falcon.testing.TestClient(app)
    assert c.simulate_get("/api/v1/queries", headers=A).status_code == 200
    pg_exec("postgresql://postgres@127.0.0.1:5432/postgres",
            "ALTER DATABASE qag_core_lost ALLOW_CONNECTIONS false")
    pg_exec("postgresql://postgres@127.0.0.1:5432/postgres",
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = 'qag_core_lost'")
    try:
        r = c.simulate_get("/api/v1/queries", headers=A)
        assert r.status_code == 503 and r.json["code"] == "store_unavailable" and r.headers["Retry-After"]
    finally:
        pg_exec("postgresql://postgres@127.0.0.1:5432/postgres",
                "ALTER DATABASE qag_core_lost ALLOW_CONNECTIONS true")
    assert c.simulate_get("/api/v1/queries", headers=A).status_code == 200
    app.runtime.store.close()


def test_quota_and_cache_ttl(app_client, sqlite_db):
    c = app_client
    post(c, "/api/v1/connections", {"name": "lite", "db": "sqlite", "database": sqlite_db}, 201)
    post(c, "/api/v1/queries", {"name": "n", "connection_name": "lite", "sql": "SELECT count(*) AS n FROM t",
                                "cache_ttl": 60, "publish": True}, 201)
    key = post(c, "/api/v1/api-keys", {"name": "q", "queries": ["n"], "quota": "3/day"}, 201).json["secret"]
    h = {"X-API-Key": key}
    first = c.simulate_get("/q/n", headers=h)
    assert first.json == [{"n": 2}] and first.headers.get("X-Cache") == "miss"
    db = sqlite3.connect(sqlite_db)
    db.execute("INSERT INTO t VALUES (3, 'cy', 'cy@z.org')")
    db.commit()
    second = c.simulate_get("/q/n", headers=h)
    assert second.json == [{"n": 2}] and second.headers["X-Cache"] == "hit"  # answered without the database
    assert c.simulate_get("/q/n", headers=h).status_code == 200
    r = c.simulate_get("/q/n", headers=h)
    assert r.status_code == 429 and r.json["code"] == "quota_exceeded" and int(r.headers["Retry-After"]) >= 1
    assert post(c, "/api/v1/api-keys", {"name": "bad", "quota": "many"}).json["code"] == "invalid_body"


def test_an_active_connection_is_reached_before_it_is_saved(app_client, sqlite_db, tmp_path):
    """Issue 15: a SQLite file that does not exist and a server that cannot be reached are reported at create
    (as /connections/test reports them) and nothing is saved; "active": false saves one on purpose, and
    activating it or pointing an active one elsewhere is reached first too."""
    from tests.conftest import free_port
    c = app_client
    missing = str(tmp_path / "nowhere" / "missing.db")
    dead = {"db": "postgres", "host": "127.0.0.1", "port": free_port(), "user": "postgres", "database": "postgres"}
    for name, body in (("lost", {"db": "sqlite", "database": missing}), ("dead", dead),
                       ("nodb", {**dead, "port": 5432, "database": "qag_no_such_database"})):
        r = post(c, "/api/v1/connections", {"name": name, **body})
        assert r.status_code == 502 and r.json["code"] == "connection_failed", (name, r.text)
        assert c.simulate_get(f"/api/v1/connections/{name}", headers=A).status_code == 404
        r = post(c, "/api/v1/connections", {"name": name, **body, "active": False}, 201)
        assert r.json["active"] is False
        r = c.simulate_patch(f"/api/v1/connections/{name}", json={"active": True}, headers=A)
        assert r.status_code == 502 and r.json["code"] == "connection_failed", r.text
        assert c.simulate_get(f"/api/v1/connections/{name}", headers=A).json["active"] is False
    post(c, "/api/v1/connections", {"name": "ok", "db": "sqlite", "database": sqlite_db}, 201)
    r = c.simulate_patch("/api/v1/connections/ok", json={"database": missing}, headers=A)
    assert r.status_code == 502 and r.json["code"] == "connection_failed"
    assert c.simulate_get("/api/v1/connections/ok", headers=A).json["database"] == sqlite_db
    # a change that does not move the connection is not probed; deactivating never is
    assert c.simulate_patch("/api/v1/connections/ok", json={"active": False}, headers=A).status_code == 200
    r = c.simulate_patch("/api/v1/connections/lost", json={"database": sqlite_db, "active": True}, headers=A)
    assert r.status_code == 200 and r.json["active"] is True
