"""The `qag` command: demo setup, shm stat against a running instance, migrate, config reference."""
import json
import os
import subprocess
import sys
import tempfile

import requests

from tests.conftest import ROOT, start_server


def run(args, env):
    return subprocess.run([sys.executable, "-m", "qag.cli", *args], env=env, capture_output=True, text=True,
                          cwd=ROOT, timeout=60)


def test_demo_sets_up_and_prints_calls_that_work():
    home = tempfile.mkdtemp()
    env = dict(os.environ, QAG_HOME=home, QAG_ADMIN_KEY="demo-admin")
    r = run(["demo", "--no-serve"], env)
    assert r.returncode == 0, r.stderr
    assert "curl -s 'http://127.0.0.1:8080/q/customer?id=1' -H 'X-API-Key: sk_" in r.stdout
    keys = [w.strip("'") for w in r.stdout.split() if w.startswith("sk_") or w.startswith("'sk_")]
    srv = start_server({"QAG_HOME": home, "QAG_ADMIN_KEY": "demo-admin"})
    try:
        plain, masked = keys[0].rstrip("'"), [k for k in keys if k.rstrip("'") != keys[0].rstrip("'")][0].rstrip("'")
        a = requests.get(srv.base + "/q/customer?id=1", headers={"X-API-Key": plain}).json()
        b = requests.get(srv.base + "/q/customer?id=1", headers={"X-API-Key": masked}).json()
        assert a == [{"id": 1, "name": "Ada Lovelace", "email": "ada@example.com", "country": "GB"}]
        assert b[0]["email"] == "a***@example.com" and b[0]["name"] != "Ada Lovelace" and len(b[0]["name"]) == 16
        st = run(["shm", "stat"], srv.env)
        assert st.returncode == 0, st.stderr
        stat = json.loads(st.stdout)
        assert stat["layout_version"] and any(p["role"] == "worker" for p in stat["process_slots"])
        before = requests.get(srv.base + "/-/shm", headers=srv.admin).json()["generations"]
        assert run(["migrate"], srv.env).returncode == 0
        after = requests.get(srv.base + "/-/shm", headers=srv.admin).json()["generations"]
        assert after != before
    finally:
        srv.stop()


def test_config_reference():
    r = run(["config", "--reference"], dict(os.environ))
    assert r.returncode == 0 and "`QAG_ADMIN_KEY`" in r.stdout
