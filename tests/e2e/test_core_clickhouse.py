"""End to end: `qag serve` recording into ClickHouse over HTTP (a loopback ClickHouse server on chDB, as
CLICKHOUSE.md describes), with history, usage and /events read back through the API; and a saved query
served from a ClickHouse connection."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

import pytest
import requests

from tests.conftest import ROOT, free_port, start_server

pytest.importorskip("chdb")
J = {"Content-Type": "application/json"}


@pytest.fixture(scope="module")
def ch_url():
    port = free_port()
    d = tempfile.mkdtemp(prefix="qag-e2e-ch-")
    proc = subprocess.Popen([sys.executable, os.path.join(ROOT, "tests", "integration", "test_runstore_http.py"),
                             os.path.join(d, "ch"), str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            cwd=ROOT)
    deadline = time.monotonic() + 90
    while True:
        try:
            if urllib.request.urlopen(f"http://127.0.0.1:{port}/ping", timeout=1).read() == b"Ok.\n":
                break
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(proc.stderr.read().decode()[-3000:]) from None
            time.sleep(0.2)
    yield f"http://127.0.0.1:{port}"
    proc.terminate()
    proc.wait(10)


def test_runs_recorded_in_clickhouse(ch_url, pgbench_dsn):
    srv = start_server({"QAG_RUN_STORE_URL": ch_url})
    try:
        def post(path, body):
            r = requests.post(srv.base + path, headers={**srv.admin, **J}, data=json.dumps(body))
            assert r.status_code in (200, 201), r.text
            return r.json()
        post("/api/v1/connections", {"name": "oltp", "db": "postgres", "host": "127.0.0.1", "port": 5432,
                                     "user": "postgres", "database": "qag_core_pgbench"})
        post("/api/v1/queries", {"name": "account", "connection_name": "oltp",
                                 "sql": "SELECT aid FROM pgbench_accounts WHERE aid = :aid",
                                 "parameters": {"aid": "int"}, "publish": True})
        key = post("/api/v1/api-keys", {"name": "k", "queries": ["account"]})["secret"]
        n_threads, per = 4, 250

        def burst(t):
            s = requests.Session()
            for i in range(per):
                aid = "x" if i % 50 == 0 else str(t * per + i + 1)  # some failures too
                s.get(srv.base + f"/q/account?aid={aid}", headers={"X-API-Key": key})
        ts = [threading.Thread(target=burst, args=(t,)) for t in range(n_threads)]
        [t.start() for t in ts]
        [t.join() for t in ts]
        total = n_threads * per
        deadline = time.time() + 60
        calls = 0
        while time.time() < deadline:
            u = requests.get(srv.base + "/api/v1/usage?per=day&query=account", headers=srv.admin).json()["items"]
            calls = sum(x["calls"] for x in u)
            if calls >= total:
                break
            time.sleep(0.5)
        assert calls == total
        assert sum(x["errors"] for x in u) == total // 50
        ids, cursor = [], None
        while True:
            url = srv.base + "/api/v1/history?query=account&limit=1000" + (f"&cursor={cursor}" if cursor else "")
            page = requests.get(url, headers=srv.admin).json()
            ids += [x["event_id"] for x in page["items"]]
            cursor = page["next_cursor"]
            if not cursor:
                break
        assert len(ids) == len(set(ids)) == total and ids == sorted(ids, reverse=True)
        r = requests.get(srv.base + f"/events?limit={total}", headers={"X-API-Key": key}, timeout=60)
        events = [int(line[4:]) for line in r.text.splitlines() if line.startswith("id: ")]
        assert sorted(events) == sorted(ids) and events == sorted(events)
    finally:
        srv.stop()
