"""End to end: a bounded schemathesis run against a disposable `qag serve`, as an administrator and as a scoped
key, over every operation of its /openapi.json: no 500, no 5xx the contract does not name (see
schemathesis_hooks.py), every answer's status documented and its body valid against the documented schema.

The budget is fixed (examples per operation, a seed) so the run is bounded in CI; locally
`QAG_ST_EXAMPLES=200 pytest tests/e2e/test_core_openapi_fuzz.py` draws more.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys

import pytest
import requests

from tests.conftest import ROOT, orders_db, start_server

pytest.importorskip("schemathesis")

EXAMPLES = os.environ.get("QAG_ST_EXAMPLES", "8")
SEED = os.environ.get("QAG_ST_SEED", "20261202")
CHECKS = "contract_server_errors,status_code_conformance,content_type_conformance,response_schema_conformance"


@pytest.fixture(scope="module")
def instance(tmp_path_factory):
    d = tmp_path_factory.mktemp("st")
    db = orders_db(str(d / "shop.db"))
    srv = start_server(args=("--workers", "1"))
    h = srv.admin
    assert requests.post(srv.base + "/api/v1/connections", json={"name": "shop", "db": "sqlite", "database": db},
                         headers=h).status_code == 201
    for q in ({"name": "orders_of", "sql": "SELECT id, total, email FROM orders WHERE cid = :cid",
               "parameters": {"cid": {"type": "int", "min": 1}}},
              {"name": "orders_all", "sql": "SELECT id, cid, total FROM orders ORDER BY id", "cache_ttl": 5}):
        r = requests.post(srv.base + "/api/v1/queries", json={**q, "connection_name": "shop", "publish": True},
                          headers=h)
        assert r.status_code == 201, r.text
    r = requests.post(srv.base + "/api/v1/api-keys", headers=h, json={
        "name": "st-scoped", "queries": ["orders_of", "orders_all"], "connections": ["shop"],
        "mask": [{"column": "orders.email", "action": "mask"}]})
    assert r.status_code == 201
    yield srv, r.json()["secret"], d
    srv.stop()


def run_st(srv, key, workdir, *extra):
    st = shutil.which("st", path=os.path.dirname(sys.executable)) or shutil.which("st")
    assert st, "schemathesis's st is not installed (the dev extra)"
    env = {**os.environ, "SCHEMATHESIS_HOOKS": "tests.e2e.schemathesis_hooks", "PYTHONPATH": str(ROOT)}
    cmd = [st, "run", srv.base + "/openapi.json", "-H", f"X-API-Key: {key}", "--checks", CHECKS,
           "--max-examples", EXAMPLES, "--seed", SEED, "--workers", "1", "--request-timeout", "20",
           "--no-color", *extra]
    return subprocess.run(cmd, cwd=workdir, env=env, capture_output=True, text=True, timeout=900)


def test_a_scoped_key_meets_the_documented_contract(instance):
    srv, secret, d = instance
    out = run_st(srv, secret, d)
    assert out.returncode == 0, out.stdout[-6000:] + out.stderr[-2000:]
    assert "API Operations" in out.stdout and "Tested:" in out.stdout, out.stdout[-2000:]


def test_an_administrator_meets_the_documented_contract(instance):
    srv, _, d = instance
    out = run_st(srv, srv.env["QAG_ADMIN_KEY"], d)
    assert out.returncode == 0, out.stdout[-6000:] + out.stderr[-2000:]
    # every operation was selected (none left out by a schema the tool could not read) and fuzzed
    m = re.search(r"Operations:\s+(\d+) selected / (\d+) total", out.stdout)
    assert m and m.group(1) == m.group(2) and int(m.group(2)) >= 30, out.stdout[:1500]
    assert "Fuzzing" in out.stdout and "Stateful" in out.stdout, out.stdout[-3000:]
