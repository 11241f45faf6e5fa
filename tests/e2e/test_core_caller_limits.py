"""A caller's own limits (issue 18 part 5, as QueryAPIGate's) through a real `qag serve` with two workers over
PostgreSQL: a key's or a role's `max_rows` (pages lowered to it, X-Page-Size the size used; streams stopped after
it, X-Row-Limit), `query_timeout` (the smallest of the server's, the key's and ?timeout=; 504 reports it) and
`max_concurrent` (calls in flight across both workers, counted in the segment: 429 too_many_concurrent with
Retry-After; a SIGKILLed worker's calls are freed when the arbiter restarts it into its slot). Signed-in callers
get their role's limits (HS256 tokens). Bad values are 400 invalid_body naming the field. A key with a limit of its
own is never served by the data plane (`qag serve --plane`): its calls are forwarded to Python, which counts them."""
from __future__ import annotations

import http.client
import os
import signal
import socket
import threading
import time
import uuid

import jwt
import pytest
import requests

from tests.conftest import need_plane, pg_exec, pg_fresh_db, start_server

ISS, AUD, SECRET = "https://idp.limits.test", "qag-limits", "hs-limits-secret-for-tests-0123456789"
JWT_ENV = {"QAG_JWT_SECRET": SECRET, "QAG_JWT_ISSUER": ISS, "QAG_JWT_AUDIENCE": AUD}
DB = "qag_limits_caller"


def _setup(srv, dsn_db: str) -> None:
    adm = srv.admin
    for path, body in (
            ("/api/v1/connections", {"name": "pg", "db": "postgres", "host": "127.0.0.1", "port": 5432,
                                     "user": "postgres", "database": dsn_db}),
            ("/api/v1/queries", {"name": "nums", "connection_name": "pg", "publish": True,
                                 "sql": "SELECT i FROM nums ORDER BY i"}),
            ("/api/v1/queries", {"name": "wide", "connection_name": "pg", "publish": True,
                                 "sql": "SELECT i, repeat('x', 1000) AS pad FROM generate_series(1, 20000) i"}),
            ("/api/v1/queries", {"name": "slow", "connection_name": "pg", "publish": True,
                                 "sql": "SELECT pg_sleep(:s)::text AS slept", "parameters": {"s": "float"}})):
        r = requests.post(srv.base + path, json=body, headers=adm, timeout=30)
        assert r.status_code == 201, r.text


@pytest.fixture(scope="module")
def srv():
    dsn = pg_fresh_db(DB)
    pg_exec(dsn, "CREATE TABLE nums AS SELECT i FROM generate_series(1, 50) i", None)
    s = start_server({**JWT_ENV, "QAG_QUERY_TIMEOUT": "8"}, args=("--workers", "2"))
    _setup(s, DB)
    yield s
    s.stop()


def _name(prefix="k") -> str:
    return prefix + uuid.uuid4().hex[:10]


class Caller:
    """An API key, or a signed-in caller whose role carries the same grants: the two ways in, one test."""

    def __init__(self, srv, kind: str, **grants):
        self.srv, self.kind = srv, kind
        body = {"queries": ["nums", "slow", "wide"], "connections": ["pg"], **grants}
        if kind == "key":
            r = requests.post(srv.base + "/api/v1/api-keys", json={"name": _name(), **body}, headers=srv.admin,
                              timeout=10)
            assert r.status_code == 201, r.text
            self.name = r.json()["name"]
            self.headers = {"X-API-Key": r.json()["secret"]}
            self.caller = self.name
        else:
            role = _name("r")
            r = requests.post(srv.base + "/api/v1/roles", json={"name": role, **body}, headers=srv.admin, timeout=10)
            assert r.status_code == 201, r.text
            sub = _name("u")
            now = int(time.time())
            token = jwt.encode({"iss": ISS, "aud": AUD, "sub": sub, "role": role, "iat": now, "exp": now + 600},
                               SECRET, algorithm="HS256")
            self.name = role
            self.headers = {"Authorization": f"Bearer {token}"}
            self.caller = "jwt:" + sub

    def get(self, query: str, base: str | None = None, **params):
        return requests.get((base or self.srv.base) + "/q/" + query, params=params, headers=self.headers,
                            timeout=30)


CALLERS = ("key", "signed_in")


# -- grants -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("path", ["/api/v1/api-keys", "/api/v1/roles"])
def test_bad_limits_are_refused_naming_the_field(srv, path):
    bad = {"max_rows": (0, -1, 1.5, "5", True, [1]), "max_concurrent": (0, -3, 2.5, "2", False, {}),
           "query_timeout": (0, -1, 0.001, "1", True, [])}
    for field, values in bad.items():
        for v in values:
            r = requests.post(srv.base + path, json={"name": _name(), field: v}, headers=srv.admin, timeout=10)
            assert r.status_code == 400, (field, v, r.text)
            assert r.json()["code"] == "invalid_body" and r.json()["field"] == field, r.json()
            assert field in r.json()["error"]
    name = _name()
    r = requests.post(srv.base + path, json={"name": name, "max_rows": 7, "query_timeout": 0.25,
                                             "max_concurrent": 3}, headers=srv.admin, timeout=10)
    assert r.status_code == 201, r.text
    got = r.json()
    assert (got["max_rows"], got["query_timeout"], got["max_concurrent"]) == (7, 0.25, 3)
    r = requests.patch(f"{srv.base}{path}/{name}", json={"max_rows": None, "max_concurrent": 0}, headers=srv.admin,
                       timeout=10)
    assert r.status_code == 400 and r.json()["field"] == "max_concurrent"
    r = requests.patch(f"{srv.base}{path}/{name}", json={"max_rows": None}, headers=srv.admin, timeout=10)
    assert r.status_code == 200, r.text
    got = requests.get(f"{srv.base}{path}/{name}", headers=srv.admin, timeout=10).json()
    assert (got["max_rows"], got["query_timeout"], got["max_concurrent"]) == (None, 0.25, 3)
    r = requests.post(srv.base + path, json={"name": _name()}, headers=srv.admin, timeout=10)
    assert (r.json()["max_rows"], r.json()["query_timeout"], r.json()["max_concurrent"]) == (None, None, None)


def test_openapi_describes_the_limits(srv):
    spec = requests.get(srv.base + "/openapi.json", headers=srv.admin, timeout=10).json()
    text = repr(spec)
    for field in ("max_rows", "query_timeout", "max_concurrent"):
        assert text.count(f"'{field}'") >= 3, field  # the key's and role's bodies, the key object


# -- max_rows -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", CALLERS)
def test_max_rows_lowers_pages_and_stops_streams(srv, kind):
    c = Caller(srv, kind, max_rows=4)
    r = c.get("nums")   # the default page_size, 10, is above it
    assert r.status_code == 200, r.text
    assert [x["i"] for x in r.json()] == [1, 2, 3, 4]
    assert (r.headers["X-Page-Size"], r.headers["X-Row-Count"], r.headers["X-Has-More"],
            r.headers["X-Row-Limit"]) == ("4", "4", "true", "4")
    r = c.get("nums", page=2, page_size=500)   # an explicit page_size above max_rows is lowered, as QueryAPIGate
    assert [x["i"] for x in r.json()] == [5, 6, 7, 8] and r.headers["X-Page-Size"] == "4"
    r = c.get("nums", page_size=3)   # below it: as asked
    assert [x["i"] for x in r.json()] == [1, 2, 3] and r.headers["X-Page-Size"] == "3"
    r = c.get("nums", stream="true", format="csv")
    assert r.status_code == 200 and r.headers["X-Row-Limit"] == "4"
    assert r.text.split("\r\n") == ["i", "1", "2", "3", "4", ""], r.text
    r = c.get("nums", stream="true", format="ndjson")
    assert [int(line.split(":")[1].strip(" }")) for line in r.text.splitlines()] == [1, 2, 3, 4]
    free = Caller(srv, kind)
    r = free.get("nums", stream="true", format="csv")
    assert "X-Row-Limit" not in r.headers and len(r.text.split("\r\n")) == 52
    r = free.get("nums")
    assert r.headers["X-Page-Size"] == "10" and "X-Row-Limit" not in r.headers


# -- query_timeout ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", CALLERS)
def test_query_timeout_narrows_the_servers_and_the_calls(srv, kind):
    c = Caller(srv, kind, query_timeout=0.5)
    t0 = time.time()
    r = c.get("slow", s=3)
    assert r.status_code == 504, r.text
    assert r.json()["code"] == "query_timeout" and r.json()["timeout"] == 0.5, r.json()
    assert time.time() - t0 < 2.5
    r = c.get("slow", s=3, timeout="0.2")   # the call's own is smaller: it holds
    assert r.status_code == 504 and r.json()["timeout"] == 0.2, r.json()
    r = c.get("slow", s=3, timeout="5")     # the call's is larger: the key's holds
    assert r.status_code == 504 and r.json()["timeout"] == 0.5, r.json()
    assert c.get("slow", s=0.05).status_code == 200
    roomy = Caller(srv, kind, query_timeout=60)   # above the server's 8 s: the server's holds
    r = roomy.get("slow", s=3, timeout="0.3")
    assert r.status_code == 504 and r.json()["timeout"] == 0.3, r.json()


# -- max_concurrent -----------------------------------------------------------------------------------------
def _slots(srv) -> list[dict]:
    return requests.get(srv.base + "/-/shm", headers=srv.admin, timeout=10).json()["process_slots"]


def _in_flight(slot: dict, caller: str) -> float:
    return slot["counters"].get(f'qag_caller_calls_in_flight{{key="{caller}"}}', 0)


def _refused(slot: dict) -> float:
    return slot["counters"].get('qag_errors_total{code="too_many_concurrent"}', 0)


def _wait_in_flight(srv, caller: str, n: int, timeout: float = 15) -> list[dict]:
    deadline = time.time() + timeout
    while True:
        slots = _slots(srv)
        if sum(_in_flight(s, caller) for s in slots) == n:
            return slots
        assert time.time() < deadline, [(s["slot"], _in_flight(s, caller)) for s in slots]
        time.sleep(0.1)


def _background(c: Caller, n: int, seconds: float) -> list[threading.Thread]:
    out = []
    for _ in range(n):
        t = threading.Thread(target=lambda: _quiet(c.get, "slow", s=seconds), daemon=True)
        t.start()
        out.append(t)
    return out


def _quiet(f, *a, **kw):
    try:
        return f(*a, **kw)
    except requests.RequestException:
        return None   # a call whose worker was killed under it


def _too_many(r, limit: int) -> None:
    assert r.status_code == 429, r.text
    body = r.json()
    assert body["code"] == "too_many_concurrent" and body["max_concurrent"] == limit and body["retry_after"] == 1
    assert r.headers["Retry-After"] == "1" and body["request_id"]


@pytest.mark.parametrize("kind", CALLERS)
def test_max_concurrent_counts_calls_on_every_worker(srv, kind):
    c = Caller(srv, kind, max_concurrent=2)
    threads = _background(c, 2, 4)
    slots = _wait_in_flight(srv, c.caller, 2)
    holding = {s["slot"]: _in_flight(s, c.caller) for s in slots}
    before = {s["slot"]: _refused(s) for s in slots}
    # Refused by a worker that holds fewer than 2 of the calls itself: the count is the host's, not the worker's.
    # Which worker takes a call is the kernel's choice, so call until one such worker has refused one.
    crossed = False
    for _ in range(60):
        _too_many(c.get("nums"), 2)
        now = {s["slot"]: _refused(s) for s in _slots(srv)}
        if any(now[s] > before.get(s, 0) and holding.get(s, 0) < 2 for s in now):
            crossed = True
            break
    assert crossed, (holding, before)
    other = Caller(srv, kind)   # another caller is not limited by this one's calls
    assert other.get("nums").status_code == 200
    for t in threads:
        t.join(30)
    _wait_in_flight(srv, c.caller, 0)
    codes = [c.get("nums").status_code for _ in range(4)]
    assert codes == [200] * 4, codes


def test_a_stream_holds_its_place_until_it_ends(srv):
    c = Caller(srv, "key", max_concurrent=1)
    # 20 MB of CSV, not read yet: the worker's sends block on full socket buffers, the stream is not over
    with requests.get(srv.base + "/q/wide", params={"stream": "true", "format": "csv"}, headers=c.headers,
                      stream=True, timeout=30) as r:
        assert r.status_code == 200
        _wait_in_flight(srv, c.caller, 1)
        time.sleep(0.5)
        _wait_in_flight(srv, c.caller, 1)
        _too_many(c.get("nums"), 1)
        assert len(r.content) > 20_000_000   # read to the end: the stream ends, its place is given back
    _wait_in_flight(srv, c.caller, 0)
    assert c.get("nums").status_code == 200


def test_a_killed_workers_calls_are_freed(srv):
    c = Caller(srv, "key", max_concurrent=1)
    _background(c, 1, 7)
    slots = _wait_in_flight(srv, c.caller, 1)
    victim = next(s for s in slots if _in_flight(s, c.caller) == 1)
    _too_many(c.get("nums"), 1)
    os.kill(victim["pid"], signal.SIGKILL)
    deadline = time.time() + 30
    while True:   # the arbiter restarts a worker into the slot; claiming it zeroes the slot's gauges
        s = _slots(srv)[victim["slot"]]
        if s["pid"] not in (0, victim["pid"]) and s["alive"]:
            break
        assert time.time() < deadline, s
        time.sleep(0.2)
    _wait_in_flight(srv, c.caller, 0)
    deadline = time.time() + 10
    while (r := c.get("nums")).status_code != 200:   # well before the killed call's 7 s were over
        assert time.time() < deadline, r.text
        time.sleep(0.2)


# -- the data plane ------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def plane_srv():
    need_plane()
    s = start_server({"QAG_WORKERS": "1"}, args=("--workers", "1", "--plane", "--plane-threads", "1"))
    _setup(s, DB)
    yield s
    s.stop()


def _served_by(srv, rids: list[str], timeout: float = 15) -> dict[str, str]:
    deadline = time.time() + timeout
    while True:
        r = requests.get(srv.base + "/api/v1/history", params={"query": "nums", "limit": 1000}, headers=srv.admin,
                         timeout=30)
        runs = {run["request_id"]: run["served_by"] for run in r.json()["items"]}
        if all(x in runs for x in rids) or time.time() > deadline:
            return runs
        time.sleep(0.3)


def test_the_plane_forwards_a_limited_keys_calls(plane_srv):
    srv = plane_srv
    port = int(srv.base.rsplit(":", 1)[1])
    plain = Caller(srv, "key")
    limited = {f: Caller(srv, "key", **{f: v}) for f, v in (("max_rows", 3), ("query_timeout", 5),
                                                             ("max_concurrent", 4))}

    def call(c: Caller, rid: str):
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        try:
            conn.request("GET", "/q/nums", headers={**c.headers, "X-Request-Id": rid})
            r = conn.getresponse()
            return r.status, r.read(), {k.lower(): v for k, v in r.getheaders()}
        finally:
            conn.close()
    rids = []
    for i in range(6):   # once warm (the plain key's entry and plan published), the plane serves the plain key
        call(plain, f"plain{i}")
        rids.append(f"plain{i}")
        for f, c in limited.items():
            status, body, headers = call(c, f"{f}{i}")
            assert status == 200, body
            if f == "max_rows":
                assert headers["x-page-size"] == "3" and body.count(b'"i"') == 3
            rids.append(f"{f}{i}")
    runs = _served_by(srv, rids)
    assert any(runs.get(f"plain{i}") == "plane" for i in range(2, 6)), runs   # the plane serves this query
    for f in limited:
        assert all(runs.get(f"{f}{i}") not in (None, "plane") for i in range(6)), (f, runs)
    # a limit added to a key the plane served: after the change, its calls are Python's
    r = requests.patch(f"{srv.base}/api/v1/api-keys/{plain.name}", json={"max_rows": 2}, headers=srv.admin,
                       timeout=10)
    assert r.status_code == 200, r.text
    status, body, headers = call(plain, "plain-after")
    assert status == 200 and headers["x-page-size"] == "2" and body.count(b'"i"') == 2
    assert _served_by(srv, ["plain-after"]).get("plain-after") not in (None, "plane")


# -- MCP tool results ---------------------------------------------------------------------------------------
def test_mcp_tool_results_keep_max_rows(srv):
    pytest.importorskip("mcp")
    import subprocess
    import sys

    from tests.conftest import ROOT, free_port
    from tests.e2e.test_core_mcp import run
    c = Caller(srv, "key", max_rows=3)
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "qag.cli", "mcp", "--bind", f"127.0.0.1:{port}", "--upstream",
                             srv.base], cwd=ROOT, env=srv.env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        url = f"http://127.0.0.1:{port}/mcp"
        deadline = time.time() + 20
        while True:   # listening (a GET of /mcp itself would wait for a server-sent stream)
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                assert time.time() < deadline, "qag mcp did not start"
                time.sleep(0.1)

        async def call(client):
            return await client.call_tool("nums", {})
        out = run(url, c.headers, call)   # the tool asks for a page of 1000 rows: the key's 3 is what it gets
        assert not out.is_error, out
        assert [r["i"] for r in out.structured_content["rows"]] == [1, 2, 3]
        assert out.structured_content["has_more"] is True
    finally:
        proc.terminate()
        proc.wait(10)


def test_the_plane_forwards_a_quota_keys_calls(plane_srv):
    """A quota is counted by Python's limiter only: the plane must not serve a key that has one (before, a key
    with only a quota was served by the plane once warm, and its calls there were never counted)."""
    srv = plane_srv
    c = Caller(srv, "key", quota="4/day")
    codes = [c.get("nums", base=srv.base).status_code for _ in range(8)]
    assert codes == [200] * 4 + [429] * 4, codes


def test_the_consoles_key_form_sets_the_limits(srv):
    import re
    s = requests.Session()
    r = s.post(srv.base + "/console/login", data={"token": srv.env["QAG_ADMIN_KEY"]}, allow_redirects=False,
               timeout=10)
    assert r.status_code == 303, r.text
    page = s.get(srv.base + "/console/keys", timeout=10)
    for field in ("max_rows", "query_timeout", "max_concurrent"):
        assert f'name="{field}"' in page.text, field
    token = re.search(r'name="csrf" value="([^"]+)"', page.text).group(1)
    name = _name("console")
    r = s.post(srv.base + "/console/keys", data={"csrf": token, "action": "create", "name": name, "max_rows": "25",
                                                 "query_timeout": "1.5", "max_concurrent": "2"},
               headers={"Origin": srv.base}, timeout=10)
    assert r.status_code == 200 and "sk_" in r.text, r.text[:500]
    got = requests.get(f"{srv.base}/api/v1/api-keys/{name}", headers=srv.admin, timeout=10).json()
    assert (got["max_rows"], got["query_timeout"], got["max_concurrent"]) == (25, 1.5, 2), got
