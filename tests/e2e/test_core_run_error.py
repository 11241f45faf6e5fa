"""The database's words of a failed call, through a real `qag serve` (shm/LAYOUT.md [Run record] RR5, issue 15
part 5): an administrator reads them in GET /api/v1/history and in the Console's Runs page (escaped), without the
call's parameter values; the scoped key that made the call gets the contract's sentence as before, cannot read
history, and its /events stream never carries the text (nor does an administrator's)."""
from __future__ import annotations

import json
import re
import sqlite3
import time

import psycopg2
import requests

PG_ADMIN = "postgresql://postgres@127.0.0.1:5432/postgres"
SCRIPT = "<script>alert(1)</script>"


def _history(srv, query: str, n: int = 1, timeout: float = 15.0) -> list[dict]:
    deadline = time.time() + timeout
    while True:
        r = requests.get(srv.base + "/api/v1/history", params={"query": query}, headers=srv.admin, timeout=10)
        assert r.status_code == 200, r.text
        items = r.json()["items"]
        if len(items) >= n or time.time() > deadline:
            return items
        time.sleep(0.2)


def _events(srv, headers: dict, n: int) -> list[dict]:
    r = requests.get(srv.base + f"/events?limit={n}", headers=headers, timeout=30)
    assert r.status_code == 200, r.text
    return [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: ")]


def test_the_database_text_is_for_administrators_only(server_factory, tmp_path):
    data = str(tmp_path / "d.db")
    db = sqlite3.connect(data)
    db.executescript("CREATE TABLE t (id INTEGER); INSERT INTO t VALUES (1);")
    db.commit()
    db.close()
    pg = psycopg2.connect(PG_ADMIN)
    pg.autocommit = True
    pg.cursor().execute("DROP DATABASE IF EXISTS qag_runerr_data")
    pg.cursor().execute("CREATE DATABASE qag_runerr_data")
    pg.close()
    srv = server_factory(args=("--workers", "1"))
    post = lambda p, b: requests.post(srv.base + p, json=b, headers=srv.admin, timeout=10)  # noqa: E731
    assert post("/api/v1/connections", {"name": "d", "db": "sqlite", "database": data}).status_code == 201
    assert post("/api/v1/connections", {"name": "p", "db": "postgres", "host": "127.0.0.1", "port": 5432,
                                        "user": "postgres", "database": "qag_runerr_data"}).status_code == 201
    queries = {
        # the database names the parameter's value: history shows [value] in its place
        "badpath": ("d", "SELECT json_extract('{}', :path) AS x FROM t", {"path": "str"}),
        # HTML in the database's words: the Console must escape it
        "script": ("d", f"SELECT json_extract('{{}}', '{SCRIPT}') AS x FROM t", {}),
        "badint": ("p", "SELECT CAST(:n AS integer) AS n", {"n": "str"}),
        "fine": ("d", "SELECT id FROM t", {}),
    }
    for name, (conn, sql, params) in queries.items():
        r = post("/api/v1/queries", {"name": name, "connection_name": conn, "publish": True, "sql": sql,
                                     "parameters": params})
        assert r.status_code == 201, r.text
    r = post("/api/v1/api-keys", {"name": "runerr_scoped", "queries": ["*"]})
    assert r.status_code == 201, r.text
    key = {"X-API-Key": r.json()["secret"]}

    calls = [("badpath", {"path": "31337-secret-path"}), ("script", {}), ("badint", {"n": "abc-31337-value"}),
             ("fine", {})]
    for name, params in calls:
        r = requests.get(srv.base + f"/q/{name}", params=params, headers=key, timeout=10)
        if name == "fine":
            assert r.status_code == 200
            continue
        assert r.status_code == 500 and r.json()["code"] == "query_failed", r.text
        assert "run history" in r.json()["error"], "the scoped caller gets the contract's sentence, as before"
        assert "JSON path" not in r.text and "integer" not in r.text and "31337" not in r.text and "script" not \
            in r.text.replace('"/q/script"', ""), "the database's words are never in a key's answer"

    # the administrator: history carries `error`
    (run,) = _history(srv, "badpath")
    assert run["status"] == 500 and run["code"] == "query_failed" and run["key_name"] == "runerr_scoped"
    assert run["error"] == "JSON path error near '[value]'", run
    (run,) = _history(srv, "badint")
    assert run["error"].startswith("invalid input syntax for type integer") and "31337" not in run["error"], run
    (run,) = _history(srv, "script")
    assert run["error"] == f"JSON path error near '{SCRIPT}'", run
    (run,) = _history(srv, "fine")
    assert run["status"] == 200 and run["error"] is None
    # an administrator's own failed call is recorded with the text too (its answer already had it)
    r = requests.get(srv.base + "/q/badint", params={"n": "zz-admin-31337"}, headers=srv.admin, timeout=10)
    assert r.status_code == 500 and "invalid input syntax" in r.json()["error"]
    runs = _history(srv, "badint", 2)
    assert runs[0]["key_name"] is None and "invalid input syntax" in runs[0]["error"] and "31337" not in \
        runs[0]["error"], runs

    # the scoped key: no history, and its event stream never has the text
    r = requests.get(srv.base + "/api/v1/history", headers=key, timeout=10)
    assert r.status_code in (401, 403) and "JSON path" not in r.text
    mine = _events(srv, key, 4)
    assert sorted(ev["query"] for ev in mine) == ["badint", "badpath", "fine", "script"]
    assert all("error" not in ev for ev in mine), mine
    r = requests.get(srv.base + "/events?limit=4", headers=key, timeout=30)
    assert "JSON path" not in r.text and "invalid input" not in r.text and "alert" not in r.text
    assert all("error" not in ev for ev in _events(srv, srv.admin, 5)), "nor does the stream an administrator reads"

    # the Console's Runs page: a run's detail shows the text, escaped
    s = requests.Session()
    r = s.post(srv.base + "/console/login", data={"token": srv.env["QAG_ADMIN_KEY"], "next": "/console/runs"},
               timeout=10)
    assert r.status_code == 200 and "/console/login" not in r.url, r.text[:300]
    page = s.get(srv.base + "/console/runs", params={"status": "5xx"}, timeout=10).text
    details = re.findall(r'<details class="run-error">.*?</details>', page, re.S)
    assert len(details) == 4, page
    assert any("JSON path error near &#39;[value]&#39;" in d for d in details), details
    assert any("&lt;script&gt;alert(1)&lt;/script&gt;" in d for d in details), details
    assert SCRIPT not in page and "31337" not in page, "escaped, and no parameter value"
    # a scoped key cannot open it
    r = requests.post(srv.base + "/console/login", data={"token": key["X-API-Key"]}, timeout=10)
    assert r.status_code == 401 and "JSON path" not in r.text
