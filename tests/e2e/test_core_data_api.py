"""End to end: `qag serve --workers 2` on a free port, the seeds' setup calls verbatim, and every row of
API.md's data-API table, over HTTP against the real PostgreSQL (pgbench schema)."""
from __future__ import annotations

import json
import time

import pytest
import requests

from tests.conftest import pg_exec, start_server

J = {"Content-Type": "application/json"}


@pytest.fixture(scope="module")
def srv(pgbench_dsn):
    s = start_server({"QAG_ALLOW_WRITES": "0"})
    yield s
    s.stop()


def post(s, path, body, expect=(200, 201)):
    r = requests.post(s.base + path, headers={**s.admin, **J}, data=json.dumps(body))
    assert r.status_code in expect, r.text
    return r


@pytest.fixture(scope="module")
def seeded(srv):
    """The seeds' own calls (001/003), verbatim but for the admin variable and the port."""
    post(srv, "/api/v1/connections", {"name": "oltp", "db": "postgres", "host": "127.0.0.1", "port": 5432,
                                      "database": "qag_core_pgbench", "user": "postgres", "password": "pw",
                                      "active": True})
    post(srv, "/api/v1/queries", {"name": "account", "connection_name": "oltp",
                                  "sql": "SELECT aid, bid, abalance FROM pgbench_accounts WHERE aid = :aid",
                                  "parameters": {"aid": {"type": "int", "required": True}},
                                  "description": "One account", "publish": True})
    post(srv, "/api/v1/queries", {"name": "account_page", "connection_name": "oltp",
                                  "sql": "SELECT a.aid, a.abalance, b.bid, b.bbalance FROM pgbench_accounts a JOIN "
                                         "pgbench_branches b ON b.bid = a.bid WHERE a.aid BETWEEN :start AND "
                                         ":start + 99 ORDER BY a.aid",
                                  "parameters": {"start": {"type": "int", "required": True}}, "publish": True})
    r = post(srv, "/api/v1/api-keys", {"name": "bench", "queries": ["account", "account_page"], "connections": []})
    assert r.headers["Cache-Control"] == "no-store"
    return {"bench": r.json()["secret"]}


def call(s, path, key, headers=None, **kw):
    h = {"X-API-Key": key} if key else {}
    h.update(headers or {})
    return requests.get(s.base + path, headers=h, **kw)


def test_seed_lookup(srv, seeded):
    r = call(srv, "/q/account?aid=42", seeded["bench"])
    assert r.status_code == 200, r.text
    assert r.json() == [{"aid": 42, "bid": 1, "abalance": 0}]
    assert r.headers["X-Page"] == "1" and r.headers["X-Page-Size"] == "10"
    assert r.headers["X-Row-Count"] == "1" and r.headers["X-Has-More"] == "false"
    assert r.headers["Content-Type"].startswith("application/json")
    assert "execute;dur=" in r.headers["Server-Timing"]


def test_request_id_echoed_or_minted(srv, seeded):
    r = call(srv, "/q/account?aid=1", seeded["bench"], headers={"X-Request-Id": "abc-1"})
    assert r.headers["X-Request-Id"] == "abc-1"
    r = call(srv, "/q/account?aid=x", seeded["bench"])
    assert r.json()["request_id"] == r.headers["X-Request-Id"] and len(r.headers["X-Request-Id"]) >= 8


def test_paging_headers_and_formats(srv, seeded):
    k = seeded["bench"]
    r = call(srv, "/q/account_page?start=1&page_size=100", k)
    rows = r.json()
    assert [x["aid"] for x in rows] == list(range(1, 101))
    assert list(rows[0]) == ["aid", "abalance", "bid", "bbalance"]
    assert r.headers["X-Has-More"] == "false" and r.headers["X-Row-Count"] == "100"
    r = call(srv, "/q/account_page?start=1&page_size=30&page=2", k)
    assert [x["aid"] for x in r.json()] == list(range(31, 61))
    assert r.headers["X-Has-More"] == "true" and r.headers["X-Page"] == "2"
    r = call(srv, "/q/account_page?start=1&page_size=30&page=4", k)
    assert [x["aid"] for x in r.json()] == list(range(91, 101)) and r.headers["X-Has-More"] == "false"
    r = call(srv, "/q/account_page?start=1&page_size=3&format=csv", k)
    assert r.headers["Content-Type"].startswith("text/csv")
    assert r.text == "aid,abalance,bid,bbalance\r\n1,0,1,0\r\n2,0,1,0\r\n3,0,1,0\r\n"
    r = call(srv, "/q/account_page?start=1&page_size=2&format=ndjson", k)
    assert r.text == '{"aid":1,"abalance":0,"bid":1,"bbalance":0}\n{"aid":2,"abalance":0,"bid":1,"bbalance":0}\n'
    # empty results are not special
    assert call(srv, "/q/account?aid=0", k).json() == []
    assert call(srv, "/q/account?aid=0&format=csv", k).text == "aid,bid,abalance\r\n"
    assert call(srv, "/q/account?aid=0&format=ndjson", k).text == ""


def test_post_body(srv, seeded):
    r = requests.post(srv.base + "/q/account", headers={"X-API-Key": seeded["bench"], **J},
                      data=json.dumps({"params": {"aid": 7}, "format": "ndjson"}))
    assert r.status_code == 200 and r.text == '{"aid":7,"bid":1,"abalance":0}\n'
    r = requests.post(srv.base + "/q/account", headers={"X-API-Key": seeded["bench"], **J},
                      data=json.dumps({"params": {"aid": 7}, "colour": "red"}))
    assert r.status_code == 400 and r.json()["code"] == "unknown_field"
    r = requests.post(srv.base + "/q/account", headers={"X-API-Key": seeded["bench"], **J}, data="{not json")
    assert r.status_code == 400 and r.json()["code"] == "invalid_body"


def test_stream(srv, seeded):
    k = seeded["bench"]
    r = call(srv, "/q/account_page?start=1&stream=true&format=csv", k, stream=True)
    assert r.status_code == 200
    lines = r.text.split("\r\n")
    assert lines[0] == "aid,abalance,bid,bbalance" and len([x for x in lines[1:] if x]) == 100
    assert "X-Page" not in r.headers
    r = call(srv, "/q/account_page?start=1&stream=true&format=ndjson", k)
    assert len(r.text.splitlines()) == 100
    for bad in ("stream=true", "stream=true&format=json", "stream=true&format=csv&page=2", "stream=maybe"):
        r = call(srv, f"/q/account_page?start=1&{bad}", k)
        assert r.status_code == 400 and r.json()["code"] == "invalid_stream", bad


# -- the error table, row by row ---------------------------------------------------------------------

def assert_error(r, status, code):
    assert r.status_code == status, r.text
    body = r.json()
    assert body["code"] == code, body
    assert isinstance(body["error"], str) and len(body["error"]) > 10
    assert body["request_id"] == r.headers["X-Request-Id"]
    return body


def test_401_every_way_and_indistinguishable(srv, seeded):
    bodies = []
    bodies.append(assert_error(call(srv, "/q/account?aid=1", None), 401, "unauthorized"))
    bodies.append(assert_error(call(srv, "/q/account?aid=1", "sk_nope"), 401, "unauthorized"))
    for name, extra in (("inactive", {"active": False}),
                        ("expired", {"expires_at": "2020-01-01T00:00:00Z"}),
                        ("elsewhere", {"allowed_ips": ["10.9.9.9/32"]})):
        secret = post(srv, "/api/v1/api-keys", {"name": name, "queries": ["account"], **extra}).json()["secret"]
        bodies.append(assert_error(call(srv, "/q/account?aid=1", secret), 401, "unauthorized"))
    assert len({b["error"] for b in bodies}) == 1
    ok = post(srv, "/api/v1/api-keys", {"name": "localonly", "queries": ["account"],
                                        "allowed_ips": ["127.0.0.0/8"]}).json()["secret"]
    assert call(srv, "/q/account?aid=1", ok).status_code == 200


def test_404_unknown_and_ungranted_alike(srv, seeded):
    post(srv, "/api/v1/queries", {"name": "branches", "connection_name": "oltp",
                                  "sql": "SELECT bid FROM pgbench_branches", "publish": True})
    a = assert_error(call(srv, "/q/branches", seeded["bench"]), 404, "query_not_found")
    b = assert_error(call(srv, "/q/nosuch", seeded["bench"]), 404, "query_not_found")
    assert a["error"].replace("branches", "X") == b["error"].replace("nosuch", "X")


def test_404_not_published(srv, seeded):
    post(srv, "/api/v1/queries", {"name": "draft", "connection_name": "oltp", "sql": "SELECT 1 AS one",
                                  "publish": False})
    secret = post(srv, "/api/v1/api-keys", {"name": "drafter", "queries": ["draft"]}).json()["secret"]
    assert_error(call(srv, "/q/draft", secret), 404, "not_published")
    post(srv, "/api/v1/queries/draft/publish", {"version": 1})
    assert call(srv, "/q/draft", secret).json() == [{"one": 1}]


def test_400_param_required_and_invalid(srv, seeded):
    k = seeded["bench"]
    b = assert_error(call(srv, "/q/account", k), 400, "param_required")
    assert b["errors"] == {"aid": "is required"}
    b = assert_error(call(srv, "/q/account?aid=abc", k), 400, "param_invalid")
    assert b["errors"] == {"aid": "must be an integer"}
    b = assert_error(call(srv, "/q/account?aid=99999999999999999999", k), 400, "param_invalid")
    b = assert_error(call(srv, "/q/account?aid=1&extra=2", k), 400, "param_invalid")
    assert set(b["errors"]) == {"extra"}


def test_1mb_parameter(srv, seeded):
    r = call(srv, "/q/account?aid=" + "1" * (1 << 20), seeded["bench"])
    assert_error(r, 400, "param_invalid")
    r = requests.post(srv.base + "/q/account", headers={"X-API-Key": seeded["bench"], **J},
                      data=json.dumps({"params": {"aid": "1" * (2 << 20)}}))
    assert_error(r, 413, "body_too_large")


def test_400_format_paging(srv, seeded):
    k = seeded["bench"]
    assert_error(call(srv, "/q/account?aid=1&format=html", k), 400, "invalid_format")
    for bad in ("page=0", "page=x", "page_size=0", "page_size=1001", "page_size=abc"):
        assert_error(call(srv, f"/q/account?aid=1&{bad}", k), 400, "invalid_paging")


def test_403_read_only_server(srv, seeded):
    post(srv, "/api/v1/queries", {"name": "deposit", "connection_name": "oltp",
                                  "sql": "UPDATE pgbench_accounts SET abalance = abalance + :delta WHERE aid = :aid",
                                  "parameters": {"aid": "int", "delta": "int"}, "publish": True})
    secret = post(srv, "/api/v1/api-keys", {"name": "writer", "queries": ["deposit"], "allow_writes": True,
                                            "allowed_write_ops": ["update"]}).json()["secret"]
    b = assert_error(call(srv, "/q/deposit?aid=5&delta=3", secret), 403, "read_only")
    assert "server" in b["error"].lower() or "QAG_ALLOW_WRITES" in b["error"]
    assert pg_exec("postgresql://postgres@127.0.0.1:5432/qag_core_pgbench",
                   "SELECT abalance FROM pgbench_accounts WHERE aid = 5") == [(0,)]


def test_multiple_statements_and_unparseable_refused_at_save(srv, seeded):
    r = requests.post(srv.base + "/api/v1/queries", headers={**srv.admin, **J},
                      data=json.dumps({"name": "two", "connection_name": "oltp",
                                       "sql": "SELECT 1; DELETE FROM pgbench_accounts"}))
    assert_error(r, 400, "multiple_statements")
    r = requests.post(srv.base + "/api/v1/queries", headers={**srv.admin, **J},
                      data=json.dumps({"name": "junk", "connection_name": "oltp", "sql": "SELEC FROM WHERE ((("}))
    assert_error(r, 400, "invalid_sql")
    assert requests.get(srv.base + "/api/v1/queries/two", headers=srv.admin).status_code == 404


def test_429_rate_limited(srv, seeded):
    secret = post(srv, "/api/v1/api-keys", {"name": "limited", "queries": ["account"],
                                            "rate_limit": "3/minute"}).json()["secret"]
    codes = [call(srv, "/q/account?aid=1", secret) for _ in range(12)]
    limited = [r for r in codes if r.status_code == 429]
    # counted across both workers (the segment), not per worker: exactly the budget gets through
    assert [r.status_code for r in codes].count(200) == 3, [r.status_code for r in codes]
    b = assert_error(limited[0], 429, "rate_limited")
    assert int(limited[0].headers["Retry-After"]) >= 1 and b["retry_after"] >= 1


def test_500_query_failed_hides_db_text_from_keys(srv, seeded):
    post(srv, "/api/v1/queries", {"name": "divide", "connection_name": "oltp", "sql": "SELECT 1 / :d AS q",
                                  "parameters": {"d": "int"}, "publish": True})
    secret = post(srv, "/api/v1/api-keys", {"name": "divider", "queries": ["divide"]}).json()["secret"]
    assert call(srv, "/q/divide?d=2", secret).json() == [{"q": 0}]
    b = assert_error(call(srv, "/q/divide?d=0", secret), 500, "query_failed")
    assert "division" not in b["error"]
    b = assert_error(call(srv, "/q/divide?d=0", srv.env["QAG_ADMIN_KEY"]), 500, "query_failed")
    assert "division by zero" in b["error"]


class TcpRelay:
    """127.0.0.1:<port> relayed to PostgreSQL while it runs: a server that is there when the connection is
    saved (an active connection is reached first) and gone when it is called."""

    def __init__(self, target=("127.0.0.1", 5432)):
        import socket
        import threading
        self.target, self.sock = target, socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.port = self.sock.getsockname()[1]
        self.open, self.running = [], True
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        import socket
        import threading
        while self.running:
            try:
                c, _ = self.sock.accept()
            except OSError:
                return
            u = socket.create_connection(self.target)
            self.open += [c, u]
            for a, b in ((c, u), (u, c)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    @staticmethod
    def _pipe(a, b):
        try:
            while data := a.recv(65536):
                b.sendall(data)
        except OSError:
            pass
        finally:
            for s in (a, b):
                try:
                    s.close()
                except OSError:
                    pass

    def stop(self):
        self.running = False
        self.sock.close()
        for s in self.open:
            try:
                s.close()
            except OSError:
                pass


def test_502_connection_failed_fast_and_no_password(srv, seeded):
    relay = TcpRelay()
    post(srv, "/api/v1/connections", {"name": "dead", "db": "postgres", "host": "127.0.0.1", "port": relay.port,
                                      "user": "postgres", "password": "hunter2", "database": "qag_core_pgbench"})
    relay.stop()  # the server goes away after the connection was saved
    post(srv, "/api/v1/queries", {"name": "deadq", "connection_name": "dead", "sql": "SELECT 1", "publish": True})
    secret = post(srv, "/api/v1/api-keys", {"name": "deadk", "queries": ["deadq"]}).json()["secret"]
    t0 = time.monotonic()
    r = call(srv, "/q/deadq", secret)
    assert time.monotonic() - t0 < 5
    assert_error(r, 502, "connection_failed")
    assert "hunter2" not in r.text
    # the pool recovers when the database comes back: point the connection at the real server
    requests.patch(srv.base + "/api/v1/connections/dead", headers={**srv.admin, **J},
                   data=json.dumps({"port": 5432, "database": "qag_core_pgbench"}))
    assert call(srv, "/q/deadq", secret).json() == [{"?column?": 1}]


def test_504_query_timeout(srv, seeded):
    post(srv, "/api/v1/queries", {"name": "sleepy", "connection_name": "oltp",
                                  "sql": "SELECT pg_sleep(:s) IS NULL AS slept", "parameters": {"s": "float"},
                                  "publish": True})
    secret = post(srv, "/api/v1/api-keys", {"name": "sleeper", "queries": ["sleepy"]}).json()["secret"]
    t0 = time.monotonic()
    b = assert_error(call(srv, "/q/sleepy?s=5&timeout=0.5", secret), 504, "query_timeout")
    assert b["timeout"] == 0.5 and time.monotonic() - t0 < 3
    # the session's own limit is restored for the next call on the same pooled connection
    assert call(srv, "/q/sleepy?s=0.7", secret).json() == [{"slept": False}]


def test_health_openapi_metrics(srv, seeded):
    h = requests.get(srv.base + "/health").json()
    assert h["status"] == "ok" and h["version"]
    doc = requests.get(srv.base + "/openapi.json", headers={"X-API-Key": seeded["bench"]}).json()
    assert doc["openapi"].startswith("3.1")
    assert "/q/account" in doc["paths"] and "/q/branches" not in doc["paths"]
    params = {p["name"]: p for p in doc["paths"]["/q/account"]["get"]["parameters"]}
    assert params["aid"]["schema"]["type"] == "integer" and params["aid"]["required"] is True
    m = requests.get(srv.base + "/metrics").text
    assert 'qag_requests_total{route="/q/{name}",status="200"}' in m


def test_unknown_route_json(srv):
    r = requests.get(srv.base + "/nope")
    assert_error(r, 404, "not_found")
    r = requests.delete(srv.base + "/health")
    assert r.status_code == 405 and r.json()["code"] == "method_not_allowed"


def test_chunked_post_body(srv, seeded):
    def body():
        yield b'{"params": '
        yield b'{"aid": 8}}'
    r = requests.post(srv.base + "/q/account", headers={"X-API-Key": seeded["bench"], **J}, data=body())
    assert r.status_code == 200 and r.json() == [{"aid": 8, "bid": 1, "abalance": 0}], r.text
