"""Logs that say why, from a real `qag serve`: a 500 query_failed and a governance refusal each write one line with
the request id, key, query and code (and the database's words for the 500), never the parameter values; calls over
QAG_SLOW_MS are logged; a misspelt QAG_* variable and a start without any administrator are warned about; a
malformed log level stops the start with its name."""
from __future__ import annotations

import os
import sqlite3
import subprocess
import sys
import time

import pytest
import requests

from tests.conftest import ROOT


def seed(srv, tmp_path) -> tuple[str, str]:
    """A SQLite connection, a query the database rejects (boom), one a scoped key may not read (secrets), and
    two keys: (scoped, plain)."""
    data = str(tmp_path / "d.db")
    db = sqlite3.connect(data)
    db.executescript("CREATE TABLE t (id INTEGER, secret TEXT); INSERT INTO t VALUES (1, 'x');")
    db.commit()
    db.close()
    post = lambda p, b: requests.post(srv.base + p, json=b, headers=srv.admin, timeout=10)  # noqa: E731
    assert post("/api/v1/connections", {"name": "d", "db": "sqlite", "database": data}).status_code == 201
    assert post("/api/v1/queries", {"name": "boom", "connection_name": "d", "publish": True,
                                    "sql": "SELECT json(:doc) AS x FROM t",
                                    "parameters": {"doc": "str"}}).status_code == 201
    assert post("/api/v1/queries", {"name": "secrets", "connection_name": "d", "publish": True,
                                    "sql": "SELECT secret FROM t"}).status_code == 201
    key = post("/api/v1/api-keys", {"name": "scoped", "queries": ["*"], "allowed_tables": ["other"]}).json()["secret"]
    plain = post("/api/v1/api-keys", {"name": "plain", "queries": ["*"]}).json()["secret"]
    return key, plain


def test_refusals_and_failures_are_logged_once_with_their_reason(server_factory, tmp_path):
    srv = server_factory({"QAG_SLOW_MS": "1", "QAG_LOG_LEVEL": "warning", "QAG_TYPO_SETTING": "1"},
                         args=("--workers", "1"))
    key, plain = seed(srv, tmp_path)
    r = requests.get(srv.base + "/q/boom", params={"doc": "31337-not-json"}, headers={"X-API-Key": plain,
                                                                           "X-Request-Id": "rid-boom"}, timeout=10)
    assert r.status_code == 500 and r.json()["code"] == "query_failed"
    assert "malformed" not in r.text, "the database's words are for administrators"
    r = requests.get(srv.base + "/q/secrets", headers={"X-API-Key": key, "X-Request-Id": "rid-refused"}, timeout=10)
    assert r.status_code == 403
    time.sleep(0.5)
    log = srv.log()
    lines = [line for line in log.splitlines() if "slow call" not in line]
    boom = [line for line in lines if "rid-boom" in line and "query_failed" in line]
    assert len(boom) == 1 and "plain" in boom[0] and "boom" in boom[0] and "malformed" in boom[0].lower(), log
    assert "31337" not in boom[0], "parameter values are never logged"
    refused = [line for line in lines if "rid-refused" in line and "403" in line]
    assert len(refused) == 1 and "table_not_allowed" in refused[0] and "scoped" in refused[0], log
    assert "slow call" in log
    assert "QAG_TYPO_SETTING is not a qag setting" in log
    assert "no administrator can sign in" not in log


def test_start_warnings_and_a_bad_log_level(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("QAG_")}
    env.update(QAG_HOME=str(tmp_path / "h"), QAG_LOG_LEVEL="loud")
    r = subprocess.run([sys.executable, "-m", "qag.cli", "serve"], env=env, cwd=ROOT, capture_output=True, text=True,
                       timeout=60)
    assert r.returncode != 0 and "QAG_LOG_LEVEL" in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_no_administrator_is_warned_about(server_factory):
    srv = server_factory({"QAG_ADMIN_KEY": ""}, args=("--workers", "1"))
    assert "qag admins create NAME" in srv.log()


def test_json_logs_one_object_per_line_from_every_process(server_factory, tmp_path):
    """QAG_LOG_FORMAT=json: every line of every process (arbiter, worker, recorder; gunicorn's own lines too)
    is one JSON object with ts, level, process, pid, logger and msg; a refusal and a failure carry their fields
    (request id, key, query, status, code, the database's text), never a parameter value."""
    import json
    srv = server_factory({"QAG_LOG_FORMAT": "json", "QAG_LOG_LEVEL": "info", "QAG_TYPO_SETTING": "1"},
                         args=("--workers", "1"))
    key, plain = seed(srv, tmp_path)
    assert requests.get(srv.base + "/q/boom", params={"doc": "31337-not-json"},
                        headers={"X-API-Key": plain, "X-Request-Id": "rid-boom"}, timeout=10).status_code == 500
    assert requests.get(srv.base + "/q/secrets", headers={"X-API-Key": key, "X-Request-Id": "rid-refused"},
                        timeout=10).status_code == 403
    time.sleep(0.5)
    srv.stop()
    lines = [line for line in srv.log().splitlines() if line.strip()]
    objs = []
    for line in lines:
        obj = json.loads(line)  # every line, or this fails naming it
        assert {"ts", "level", "process", "pid", "logger", "msg"} <= set(obj), line
        objs.append(obj)
    processes = {o["process"] for o in objs}
    assert {"arbiter", "worker:0", "recorder"} <= processes, processes
    assert any(o["logger"] == "gunicorn.error" for o in objs)
    assert any("QAG_TYPO_SETTING is not a qag setting" in o["msg"] for o in objs)
    boom = [o for o in objs if o.get("request_id") == "rid-boom"]
    assert len(boom) == 1 and boom[0]["code"] == "query_failed" and boom[0]["status"] == 500, boom
    assert boom[0]["key"] == "plain" and boom[0]["query"] == "boom" and "malformed" in boom[0]["db_text"].lower()
    refused = [o for o in objs if o.get("request_id") == "rid-refused"]
    assert len(refused) == 1 and refused[0]["code"] == "table_not_allowed" and refused[0]["key"] == "scoped"
    assert "31337" not in srv.log(), "parameter values are never logged"


def test_a_bad_log_format_is_refused_in_one_line(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("QAG_")}
    env.update(QAG_HOME=str(tmp_path / "h"), QAG_LOG_FORMAT="xml")
    r = subprocess.run([sys.executable, "-m", "qag.cli", "serve"], env=env, cwd=ROOT, capture_output=True, text=True,
                       timeout=60)
    assert r.returncode != 0 and "QAG_LOG_FORMAT" in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_json_logs_from_the_plane_too(server_factory, plane):
    """The plane's lines follow QAG_LOG_FORMAT as every other process's do."""
    import json
    srv = server_factory({"QAG_LOG_FORMAT": "json", "QAG_LOG_LEVEL": "info"},
                         args=("--workers", "1", "--plane", "--plane-threads", "1"))
    assert requests.get(srv.base + "/health", timeout=10).status_code == 200
    srv.stop()
    objs = [json.loads(line) for line in srv.log().splitlines() if line.strip()]
    plane_lines = [o for o in objs if o["process"] == "plane"]
    assert any(o["msg"].startswith("listening on ") for o in plane_lines), objs
    assert all(o["logger"] == "qag.plane" and o["level"] in ("info", "warning", "error") for o in plane_lines)
    assert {"arbiter", "worker:0", "recorder", "plane"} <= {o["process"] for o in objs}


@pytest.mark.parametrize("log_params", ["0", "1"])
def test_the_databases_words_in_a_log_line_carry_no_parameter_value(server_factory, log_params):
    """PostgreSQL quotes the value it could not read ('invalid input syntax for type integer: "..."'): the log
    line replaces it with [value], as the run history does, unless QAG_LOG_PARAMS=1 asks for the words as
    they are."""
    from tests.conftest import pg_fresh_db
    pg_fresh_db("qag_core_logs")
    srv = server_factory({"QAG_LOG_LEVEL": "warning", "QAG_LOG_PARAMS": log_params}, args=("--workers", "1"))
    post = lambda p, b: requests.post(srv.base + p, json=b, headers=srv.admin, timeout=10)  # noqa: E731
    assert post("/api/v1/connections", {"name": "pg", "db": "postgres", "host": "127.0.0.1", "port": 5432,
                                        "user": "postgres", "database": "qag_core_logs"}).status_code == 201
    assert post("/api/v1/queries", {"name": "cast", "connection_name": "pg", "publish": True,
                                    "sql": "SELECT CAST(:n AS integer) AS x",
                                    "parameters": {"n": "str"}}).status_code == 201
    plain = post("/api/v1/api-keys", {"name": "plain", "queries": ["*"], "connections": ["pg"]}).json()["secret"]
    r = requests.get(srv.base + "/q/cast", params={"n": "zz-secret-31337"},
                     headers={"X-API-Key": plain, "X-Request-Id": "rid-cast"}, timeout=10)
    assert r.status_code == 500 and "zz-secret" not in r.text
    time.sleep(0.5)
    line = [x for x in srv.log().splitlines() if "rid-cast" in x]
    assert len(line) == 1 and "invalid input syntax" in line[0], srv.log()
    if log_params == "1":
        assert "zz-secret-31337" in line[0]
    else:
        assert "zz-secret-31337" not in line[0] and "[value]" in line[0], line[0]
