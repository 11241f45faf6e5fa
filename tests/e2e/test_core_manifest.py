"""End to end: `qag export` and `qag apply` (config as code) against real `qag serve` instances."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import requests
import yaml

from tests.conftest import ROOT, orders_db, start_server


def qag(srv, *args, env=None, stdin=None):
    e = {**os.environ, "QAG_ADMIN_KEY": srv.env["QAG_ADMIN_KEY"], **(env or {})}
    return subprocess.run([sys.executable, "-m", "qag.cli", *args, "--url", srv.base], env=e, cwd=ROOT,
                          capture_output=True, text=True, timeout=120, input=stdin)


def api(srv, method, path, body=None, status=None):
    r = requests.request(method, srv.base + path, json=body, headers=srv.admin, timeout=30)
    if status is not None:
        assert r.status_code == status, (method, path, r.status_code, r.text)
    return r.json() if r.content else None


def audit_count(srv) -> int:
    return len(api(srv, "GET", "/api/v1/audit?limit=1000", status=200)["items"])


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    d = tmp_path_factory.mktemp("manifest")
    db = orders_db(str(d / "shop.db"))
    a = start_server()
    b = start_server()
    api(a, "POST", "/api/v1/connections", {"name": "shop", "db": "sqlite", "database": db}, 201)
    api(a, "POST", "/api/v1/connections", {"name": "pg", "db": "postgres", "host": "127.0.0.1", "port": 5432,
                                           "user": "postgres", "password": "pg-secret-1", "database": "postgres"},
        201)
    api(a, "POST", "/api/v1/queries", {"name": "orders", "connection_name": "shop", "publish": True,
                                       "sql": "SELECT id, total FROM orders WHERE cid = :cid",
                                       "parameters": {"cid": "int"}}, 201)
    api(a, "POST", "/api/v1/queries/orders/versions", {"sql": "SELECT id, total, email FROM orders WHERE cid = :cid",
                                                       "parameters": {"cid": {"type": "int", "min": 1}},
                                                       "publish": True}, 201)
    api(a, "POST", "/api/v1/roles", {"name": "analyst", "queries": ["orders"], "connections": ["shop"]}, 201)
    api(a, "POST", "/api/v1/api-keys", {"name": "reports", "queries": ["orders"], "connections": ["shop"],
                                        "mask": [{"column": "orders.email", "action": "mask"}],
                                        "rate_limit": "10/second"}, 201)
    yield a, b, d
    a.stop()
    b.stop()


def test_export_apply_round_trip_is_idempotent_and_keeps_secrets_out(pair):
    a, b, d = pair
    out = qag(a, "export")
    assert out.returncode == 0, out.stderr
    assert "pg-secret-1" not in out.stdout
    m = yaml.safe_load(out.stdout)
    assert m["qag"] == 1
    assert m["connections"]["pg"]["password"] == "${QAG_SECRET_PG_PASSWORD}"
    assert "password" not in m["connections"]["shop"]
    assert [v["sql"] for v in m["queries"]["orders"]["versions"]] == [
        "SELECT id, total FROM orders WHERE cid = :cid", "SELECT id, total, email FROM orders WHERE cid = :cid"]
    assert m["queries"]["orders"]["published"] == 2
    assert m["keys"]["reports"]["mask"] == [{"column": "orders.email", "action": "mask"}]
    assert "secret" not in m["keys"]["reports"] and "prefix" not in m["keys"]["reports"]
    f = d / "qag.yaml"
    f.write_text(out.stdout)

    missing = qag(b, "apply", "-f", str(f))
    assert missing.returncode == 2 and "QAG_SECRET_PG_PASSWORD is not set" in missing.stderr
    assert api(b, "GET", "/api/v1/connections", status=200)["items"] == []  # nothing half-applied

    dry = qag(b, "apply", "-f", str(f), "--dry-run", env={"QAG_SECRET_PG_PASSWORD": "pg-secret-1"})
    assert dry.returncode == 0, dry.stderr
    assert "+ connection pg" in dry.stdout and "+ query orders version 2 (published)" in dry.stdout
    assert "dry run: nothing changed" in dry.stdout
    assert api(b, "GET", "/api/v1/queries", status=200)["items"] == []

    first = qag(b, "apply", "-f", str(f), env={"QAG_SECRET_PG_PASSWORD": "pg-secret-1"})
    assert first.returncode == 0, first.stderr
    assert "+ key reports" in first.stdout and "secret sk_" in first.stdout
    # B now matches A, and its key works with the masks of the file
    again = yaml.safe_load(qag(b, "export").stdout)
    assert again == m
    secret = first.stdout.split("secret ", 1)[1].split()[0]
    rows = requests.get(b.base + "/q/orders?cid=7", headers={"X-API-Key": secret}, timeout=10).json()
    assert [r["id"] for r in rows] == [1] and rows[0]["email"] != "ann@example.com", rows
    assert rows[0]["email"].endswith("@example.com")
    # the password reached B's connection (the API shows that one is stored, never which)
    assert api(b, "GET", "/api/v1/connections/pg", status=200)["password"] == "********"
    assert api(b, "GET", "/api/v1/connections/shop", status=200)["password"] is None

    n = audit_count(b)
    second = qag(b, "apply", "-f", str(f), env={"QAG_SECRET_PG_PASSWORD": "pg-secret-1"})
    assert second.returncode == 0, second.stderr
    assert "nothing to change" in second.stdout
    assert audit_count(b) == n


def test_apply_refuses_bad_manifests_and_changes_nothing(pair):
    a, b, d = pair
    base = yaml.safe_load(qag(a, "export").stdout)
    cases = {
        "unknown top-level": ({**base, "users": {}}, "unknown top-level field(s) users"),
        "unknown field": ({**base, "keys": {"k2": {"queries": ["orders"], "colour": "red"}}},
                          "keys.k2: unknown field(s) colour"),
        "secret in clear": ({**base, "connections": {**base["connections"],
                                                     "pg2": {"db": "postgres", "password": "hunter2"}}},
                            "connections.pg2.password: a secret in clear is refused"),
        "key secret": ({**base, "keys": {"k3": {"secret": "sk_x"}}}, "keys' secrets are never in a manifest"),
        "no format": ({k: v for k, v in base.items() if k != "qag"}, "`qag: 1` is missing"),
        "changed version": ({**base, "queries": {"orders": {**base["queries"]["orders"], "versions": [
            {**base["queries"]["orders"]["versions"][0], "sql": "SELECT 1"},
            base["queries"]["orders"]["versions"][1]]}}}, "versions cannot change"),
        "fewer versions": ({**base, "queries": {"orders": {**base["queries"]["orders"], "published": 1,
                                                           "versions": base["queries"]["orders"]["versions"][:1]}}},
                           "versions cannot be deleted"),
    }
    n = audit_count(a)
    for name, (doc, message) in cases.items():
        f = d / f"bad-{name.replace(' ', '-')}.yaml"
        f.write_text(yaml.safe_dump(doc))
        out = qag(a, "apply", "-f", str(f), env={"QAG_SECRET_PG_PASSWORD": "x"})
        assert out.returncode == 2, (name, out.stdout, out.stderr)
        assert message in out.stderr and "nothing changed" in out.stderr, (name, out.stderr)
    assert audit_count(a) == n


def test_apply_undoes_its_own_changes_when_the_instance_refuses_one(pair):
    a, _, d = pair
    doc = yaml.safe_load(qag(a, "export").stdout)
    doc["connections"]["extra"] = {"db": "sqlite", "database": str(d / "shop.db")}
    doc["roles"]["analyst"]["queries"] = []
    doc["keys"]["broken"] = {"queries": ["orders"], "connections": ["shop"], "rate_limit": "lots"}
    f = d / "refused.yaml"
    f.write_text(yaml.safe_dump(doc))
    out = qag(a, "apply", "-f", str(f), env={"QAG_SECRET_PG_PASSWORD": "x"})
    assert out.returncode == 1, (out.stdout, out.stderr)
    assert "refused at `+ key broken`" in out.stderr and "undone: `+ connection extra" in out.stderr
    names = {c["name"] for c in api(a, "GET", "/api/v1/connections", status=200)["items"]}
    assert "extra" not in names
    assert api(a, "GET", "/api/v1/roles/analyst", status=200)["queries"] == ["orders"]


def test_prune_deletes_what_the_file_lacks(pair):
    a, _, d = pair
    api(a, "POST", "/api/v1/api-keys", {"name": "temp", "queries": ["orders"], "connections": ["shop"]}, 201)
    doc = yaml.safe_load(qag(a, "export").stdout)
    del doc["keys"]["temp"]
    f = d / "prune.yaml"
    f.write_text(yaml.safe_dump(doc))
    kept = qag(a, "apply", "-f", str(f), env={"QAG_SECRET_PG_PASSWORD": "x"})
    assert kept.returncode == 0 and "kept (--prune deletes them): key temp" in kept.stdout
    pruned = qag(a, "apply", "-f", str(f), "--prune", env={"QAG_SECRET_PG_PASSWORD": "x"})
    assert pruned.returncode == 0, pruned.stderr
    assert "- key temp" in pruned.stdout
    assert api(a, "GET", "/api/v1/api-keys/temp").get("code") == "key_not_found"


def test_admins_list_and_config_json(tmp_path):
    env = {**os.environ, "QAG_HOME": str(tmp_path), "QAG_DATABASE_URL": "", "QAG_REDIS_URL": "redis://:pw@h:6379/0"}
    run = lambda *a: subprocess.run([sys.executable, "-m", "qag.cli", *a], env=env, cwd=ROOT,  # noqa: E731
                                    capture_output=True, text=True, timeout=60)
    assert run("admins", "create", "alice").returncode == 0
    assert run("admins", "create", "bob").returncode == 0
    assert run("admins", "revoke", "bob").returncode == 0
    listed = run("admins", "list", "--json")
    rows = yaml.safe_load(listed.stdout)
    assert [(r["name"], r["active"]) for r in rows] == [("alice", True), ("bob", False)]
    assert "qa_" not in listed.stdout
    conf = yaml.safe_load(run("config", "--json").stdout)
    assert conf["home"] == {"env": "QAG_HOME", "value": str(tmp_path), "source": "environment"}
    assert conf["threads"]["source"] == "default"
    assert conf["redis_url"]["value"] == "redis://:***@h:6379/0"
